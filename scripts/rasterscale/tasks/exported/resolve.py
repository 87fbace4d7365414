"""The config's exported model (torch-free until a file is checked): its card resolved from ``model.file`` and
``model.card`` (:func:`exported_card`), checked against the file once per file state at dry run, and the
prediction job's model (:func:`exported_model`). Torch and ONNX Runtime are imported only to load a file
(:mod:`rasterscale.tasks.exported.runtime`)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

from rasterscale.settings import ModelSettings, Settings
from rasterscale.tasks.exported.card import CardRules, ModelCard, card_error, is_exported, read_card
from rasterscale.tasks.modelfiles import starting_model_file

if TYPE_CHECKING:
    from rasterscale.tasks.exported.runtime import ExportedDense


def exported_card(settings: Settings, rules: CardRules, check: bool = True) -> ModelCard | None:
    """The card of the config's exported model file (``model.file``), None when it names none. ``check``: the dry
    run's check of the card against the file (:func:`rasterscale.tasks.exported.runtime.check_exported`, run once
    per file state). An exported file as ``train.init``: one line (exported files predict only)."""
    path, new_head = starting_model_file(settings)
    return card_of_file(path, new_head, settings, rules, check)


def card_of_file(
    path: str | None, new_head: bool, settings: Settings, rules: CardRules, check: bool
) -> ModelCard | None:
    """:func:`exported_card` of the model file ``path`` (``new_head``: it is ``train.init``)."""
    model = settings.model
    if not path or not is_exported(path, model):
        if model.card:
            raise card_error("model.card", "set, but model.file names no exported model (.onnx, .pt2, TorchScript)")
        return None
    if new_head:
        raise card_error(
            str(path),
            "train.init is an exported model: exported files (ONNX, torch.export, TorchScript) predict only "
            "(model.file); train from a rasterscale model file or from scratch",
        )
    card = read_card(path, model, rules, settings.tiling.patch_size)
    check_model_keys(card, model)
    if check:
        stat = Path(path).stat()
        checked(card, stat.st_size, stat.st_mtime_ns)
    return card


# model.* keys that build or train a network: an exported file's card says what it is instead
NETWORK_KEYS = ("architecture", "encoder", "encoder_weights", "backbone", "loss", "band_names", "normalize")


def check_model_keys(card: ModelCard, model: ModelSettings) -> None:
    """``model.*`` keys beside an exported file: those that build a network are refused (the card says what the
    file is), ``model.labels`` must be the card's (compared without regard to case)."""
    network = (
        model.architecture,
        model.encoder,
        model.encoder_weights,
        model.backbone,
        model.loss,
        model.band_names,
        model.normalize,
    )
    for key, value in zip(NETWORK_KEYS, network, strict=True):
        if value:
            raise card_error(
                f"model.{key}",
                f"does not apply to an exported model ({card.path}): its card ({card.source}) says what it takes "
                "and gives; leave the key out",
            )
    labels = model.labels
    if labels and [x.casefold() for x in labels] != [x.casefold() for x in card.labels]:
        raise card_error(
            "model.labels",
            f"[{', '.join(labels)}] but the card of {card.path} gives [{', '.join(card.labels)}]; leave it out",
        )


@functools.lru_cache(maxsize=16)
def checked(card: ModelCard, size: int, mtime_ns: int) -> None:
    """The card checked against its file (torch, and onnxruntime for ONNX, imported only here), once per file
    state: loading it, its declared input, a dummy tile's output shape."""
    from rasterscale.tasks.exported.runtime import check_exported

    check_exported(card)


def exported_model(path: str | Path, settings: Settings, rules: CardRules) -> tuple[ExportedDense, ModelCard] | None:
    """The prediction job's model when ``path`` is an exported file (its card from the config or beside it),
    loaded and checked; None for a rasterscale model file."""
    from rasterscale.tasks.exported.runtime import load_exported

    card = card_of_file(str(path), False, settings, rules, check=False)
    return None if card is None else (load_exported(card), card)
