"""The config's files that live elsewhere, settled while the config is validated (on ``snakemake -n`` too):

- a file that is read whole (a scene's ``annotations``, ``model.file`` and the card beside an exported model,
  ``model.card``) may be an S3 object (``s3://bucket/key``): its key is given a local copy in its place
  (:func:`rasterscale.raster.s3.local_copy`), kept while the object's ETag stays the same, so the jobs,
  Snakemake's inputs and the checks read a local file;
- a URL with a user name or password in it (``https://user:password@host/...``) is refused, whatever the key: the
  config's paths are written into the job files and the stored plan, and credentials belong in the environment
  or a profile (a signed URL's token is the URL's own and is kept: docs/data.md, "Object storage").
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from rasterscale.errors import URL, ConfigError
from rasterscale.raster.s3 import is_s3, local_copy
from rasterscale.tasks.exported.card import card_path

WHOLE_FILES = ("file", "card")  # the model's keys naming files that are read whole


def fetch_whole_files(config: dict[str, Any]) -> None:
    """Replace each S3 object the config reads whole by the path of its local copy, in place."""
    for name, scene in config["scenes"].items():
        if is_s3(scene.get("annotations")):
            scene["annotations"] = _copy(scene["annotations"], f"scenes.{name}.annotations")
    model, url = config["model"], config["model"].get("file")
    for key in WHOLE_FILES:
        if is_s3(model.get(key)):
            model[key] = _copy(model[key], f"model.{key}")
    if is_s3(url) and not model.get("card"):  # an exported model's card beside it (card_path), if there is one
        beside = str(card_path(model["file"]))[len(model["file"]) :]
        _copy(url + beside, "model.file", missing_ok=True)


def _copy(url: str, key: str, missing_ok: bool = False) -> str:
    """The local copy of ``url`` (one line naming the key when it cannot be fetched)."""
    try:
        return local_copy(url, missing_ok=missing_ok) or ""
    except ValueError as err:
        raise ConfigError(f"config: key '{key}': {err}") from err


def refuse_credentials_in_urls(config: dict[str, Any]) -> None:
    """One line naming the first key whose URL carries a user name or password (shown redacted)."""
    for key, value in _paths(config):
        match = URL.search(value)
        if match and match["user"]:
            raise ConfigError(
                f"config: key '{key}': the URL {value} has credentials in it (user:password@), which would be written "
                "into the job files and the stored plan; give them to GDAL instead (GDAL_HTTP_USERPWD or a ~/.netrc "
                "for http(s), AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or an AWS profile for s3://) and remove them "
                "from the URL"
            )


def _paths(config: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for name, scene in config["scenes"].items():
        for key in ("path", "stac", "annotations"):
            if isinstance(scene.get(key), str):
                yield f"scenes.{name}.{key}", scene[key]
    for index, source in enumerate(config["stac"].get("items", ())):
        yield f"stac.items[{index}]", source
    for key in WHOLE_FILES:
        if isinstance(config["model"].get(key), str):
            yield f"model.{key}", config["model"][key]
