"""Models brought as exported files, for the dense tasks' prediction: a TorchScript file, a ``torch.export``
program (``.pt2``) or an ONNX file, with a model card that says what the file does not
(:mod:`rasterscale.tasks.exported.card`, torch-free), resolved from the config
(:mod:`rasterscale.tasks.exported.resolve`, torch-free until a file is loaded). The dry run checks the card
against the file and the prediction job runs it behind the card's normalization
(:mod:`rasterscale.tasks.exported.runtime`)."""
