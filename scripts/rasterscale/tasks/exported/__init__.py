"""Models brought as exported files, for the dense tasks' prediction: a TorchScript file, a ``torch.export``
program (``.pt2``) or an ONNX file, with a model card that says what the file does not
(:mod:`rasterscale.tasks.exported.card`, torch-free). The dry run checks the card against the file
(:mod:`rasterscale.tasks.exported.check`); the prediction job runs it behind the card's normalization
(:mod:`rasterscale.tasks.exported.runtime`)."""
