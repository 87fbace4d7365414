"""Points: objects as points (tree tops, birds, animals) from point annotations, found as the peaks of a heatmap that
an smp network predicts, each point kept once across tiles, scenes and seams, and scored by one-to-one matching
within a distance."""
