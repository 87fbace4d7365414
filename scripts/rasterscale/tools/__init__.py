"""Tools beside the workflow: the synthetic demo scenes, the configuration reference, the environment check."""
