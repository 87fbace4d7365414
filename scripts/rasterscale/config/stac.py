"""Scenes from STAC: a scene's raster may be an asset of a STAC Item (``scenes.X.stac`` and ``scenes.X.asset``), and
the ``stac`` section lists Items and ItemCollections (a search's results saved as JSON), a scene per item named by
its id. Each Item is a local JSON file, an http(s) URL or an S3 object (``s3://``), read once per invocation (with
the scene tables and globs, before validation) as plain JSON, an ItemCollection's items one at a time
(:func:`iter_items`; pystac took 490 µs an item, 98 s for 200,000); the scene's ``path`` is the asset's href made
absolute (a relative href against the item's own location), and a URL's raster is read where it lives
(:mod:`rasterscale.raster.remote`). An item that will not read, or one without the asset, fails with one line naming
it.

Where the item says what its asset's raster is (the ``proj`` extension and the bands' data type:
:mod:`rasterscale.raster.item_header`), the scene's :class:`~rasterscale.raster.item_header.ItemHeader` is given
to the caller (``headers``, by scene name): the plan trusts it and reads no header of that raster."""

from __future__ import annotations

import json
import os
import posixpath
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from rasterscale.config.scenes import STAC_ORIGIN, sanitized_scene_name
from rasterscale.errors import ConfigError, InputError
from rasterscale.raster.item_header import ItemHeader, item_header
from rasterscale.raster.s3 import bucket_and_key, is_s3, read_object

DEFAULT_ASSET = "visual"  # STAC's role and common key of a true-colour (RGB uint8) asset
TIMEOUT_S = 60  # reading one item or collection over HTTP


def is_url(source: str) -> bool:
    return source.startswith(("https://", "http://"))


def read_text(source: str) -> str:
    """The text of a local file, an http(s) URL or an S3 object; one line naming it when it cannot be read."""
    try:
        if is_s3(source):
            return read_object(source).decode("utf-8")
        if is_url(source):
            request = urllib.request.Request(source, headers={"Accept": "application/geo+json, application/json"})
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
                return str(response.read().decode("utf-8"))
        return Path(source).read_text(encoding="utf-8")
    except InputError:
        raise  # an S3 object's one line, already naming it
    except FileNotFoundError as err:
        raise InputError(f"{source}: STAC item not found") from err
    except urllib.error.HTTPError as err:
        raise InputError(f"{source}: STAC item cannot be read (HTTP {err.code}: {err.reason})") from err
    except (OSError, urllib.error.URLError, UnicodeDecodeError, ValueError) as err:
        reason = getattr(err, "reason", None) or err
        raise InputError(f"{source}: STAC item cannot be read ({reason})") from err


Item = Mapping[str, Any]  # a STAC Item's JSON


def read_items(source: str) -> list[Item]:
    """The STAC Items of a source (:func:`iter_items`) in a list."""
    return list(iter_items(source))


def iter_items(source: str) -> Iterator[Item]:
    """The STAC Items of a source, one at a time: one Item, or the items of an ItemCollection (a GeoJSON
    FeatureCollection), each checked to have an ``id`` and ``assets``. A collection's features are decoded one
    after another from its text (:class:`_Members`), never all at once: 200,000 items as one parse held 1.75 GiB
    of Python objects for a 260 MB file; one at a time, the text and one item."""
    text = read_text(source)
    head: dict[str, Any] = {}
    streamed = False
    try:
        for key, value in _Members(text):
            if isinstance(value, Iterator):
                streamed = True
                yield from (_checked(item, source) for item in value)
            else:
                head[key] = value
    except json.JSONDecodeError as err:
        raise InputError(f"{source}: STAC item is not JSON ({err})") from err
    kind = head.get("type")
    expected = ("FeatureCollection",) if streamed else ("Feature", "FeatureCollection")
    if kind not in expected:
        raise InputError(
            f"{source}: not a STAC Item or ItemCollection (its type is {kind!r}, not 'Feature' or 'FeatureCollection')"
        )
    if kind == "Feature":
        yield _checked(head, source)
    elif not streamed:
        raise InputError(f"{source}: not a valid STAC ItemCollection (its 'features' is no list)")


def _checked(item: Any, source: str) -> Item:
    if not isinstance(item, dict) or not isinstance(item.get("id"), str) or not isinstance(item.get("assets"), dict):
        what = (
            "an item without an 'id' or 'assets'" if isinstance(item, dict) else f"{type(item).__name__} {item!r:.40}"
        )
        raise InputError(f"{source}: not a valid STAC item ({what})")
    return item


_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"[ \t\n\r]*")


class _Members:
    """The members of a JSON object's text, as (key, value); the value of ``features``, an array, as an iterator of
    its elements, decoded one at a time (consume it before the next member). Anything but an object is one
    member, ("", value). Malformed text raises json.JSONDecodeError."""

    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        start = self._skip(0)
        if not self.text.startswith("{", start):
            yield "", json.loads(self.text)
            return
        self.pos = self._skip(start + 1)
        if self._expect("}", optional=True):
            return self._end()
        while True:
            key, self.pos = _DECODER.raw_decode(self.text, self.pos)
            self._expect(":")
            if key == "features" and self.text.startswith("[", self.pos):
                self.pos += 1
                yield key, self._elements()
            else:
                value, self.pos = _DECODER.raw_decode(self.text, self.pos)
                yield key, value
            if self._expect("}", optional=True):
                return self._end()
            self._expect(",")

    def _elements(self) -> Iterator[Any]:
        self.pos = self._skip(self.pos)
        if self._expect("]", optional=True):
            return
        while True:
            value, self.pos = _DECODER.raw_decode(self.text, self.pos)
            yield value
            if self._expect("]", optional=True):
                return
            self._expect(",")

    def _skip(self, pos: int) -> int:
        found = _SPACE.match(self.text, pos)
        return found.end() if found else pos

    def _expect(self, char: str, optional: bool = False) -> bool:
        """Past ``char`` (and the spaces around it) when it comes next; else False, or an error when not optional."""
        pos = self._skip(self.pos)
        if self.text.startswith(char, pos):
            self.pos = self._skip(pos + 1)
            return True
        if optional:
            return False
        raise json.JSONDecodeError(f"Expecting '{char}'", self.text, pos)

    def _end(self) -> None:
        if self.pos != len(self.text):
            raise json.JSONDecodeError("Extra data", self.text, self.pos)


def item_asset(item: Item, asset: str, source: str, key: str) -> Mapping[str, Any]:
    """An item's asset; one line naming the item and the key to set when it has none of that name."""
    assets = item["assets"]
    found = assets.get(asset)
    if not isinstance(found, dict) or not isinstance(found.get("href"), str):
        known = ", ".join(sorted(assets)) or "none"
        raise ConfigError(f"{source}: STAC item '{item['id']}' has no asset '{asset}' (its assets: {known}); set {key}")
    return found


def asset_path(item: Item, asset: Mapping[str, Any], source: str) -> str:
    """The raster of an item's asset: its href, made absolute against the item's location (its self link, else
    where it was read) when relative."""
    href = str(asset["href"])
    if "://" in href or href.startswith("/"):
        return href
    base = _self_href(item) or (source if is_url(source) or is_s3(source) else str(Path(source).resolve()))
    if is_url(base):
        return urllib.parse.urljoin(base, href)
    if is_s3(base):  # urljoin knows no s3:// scheme
        bucket, key = bucket_and_key(base)
        return f"s3://{bucket}/{posixpath.normpath(posixpath.join(posixpath.dirname(key), href))}"
    return os.path.normpath(os.path.join(os.path.dirname(base), href))


def _self_href(item: Item) -> str | None:
    for link in item.get("links") or ():
        if isinstance(link, dict) and link.get("rel") == "self" and isinstance(link.get("href"), str):
            href: str = link["href"]
            return href if "://" in href or href.startswith("/") else None
    return None


def scene_of(
    item: Item,
    asset_name: str,
    source: str,
    key: str,
    headers: dict[str, ItemHeader] | None,
    name: str,
    data_type: str | None = None,
) -> str:
    """The path of an item's asset, with its trusted header put under ``name`` in ``headers`` when the item has it
    (``data_type``: the bands' where the item gives none, ``stac.data_type``)."""
    asset = item_asset(item, asset_name, source, key)
    if headers is not None:
        header = item_header(item, asset, source, data_type)
        if header is not None:
            headers[name] = header
    return asset_path(item, asset, source)


def item_origin(item_id: str, source: str) -> str:
    return f"{STAC_ORIGIN} '{item_id}' of {source}"


def scenes_from_section(
    section: Mapping[str, Any], headers: dict[str, ItemHeader] | None = None
) -> tuple[dict[str, Any], dict[str, str]]:
    """The scenes of the ``stac`` section: one per item of each source in ``stac.items``, named by the item's id,
    its path the ``stac.asset`` asset's, with ``stac.bands``, ``stac.scale`` and ``stac.normalize`` when set; and
    their origins (``headers``: each trusted item header by scene name)."""
    scenes: dict[str, Any] = {}
    origins: dict[str, str] = {}
    shared = {key: section[key] for key in ("bands", "scale", "normalize") if key in section}
    for source in section.get("items", []):
        for item in iter_items(source):
            item_id = item["id"]
            name = sanitized_scene_name(item_id)
            if not name:
                raise ConfigError(f"{source}: STAC item id '{item_id}' gives no usable scene name")
            if name in scenes:
                raise ConfigError(
                    f"config: key 'stac.items': {item_origin(item_id, source)} gives the scene name '{name}', as "
                    f"{origins[name]} does: a scene per item"
                )
            asset = section.get("asset", DEFAULT_ASSET)
            path = scene_of(item, asset, source, "stac.asset", headers, name, section.get("data_type"))
            scenes[name] = {"path": path, **shared}
            origins[name] = item_origin(item_id, source)
    return scenes, origins


def resolve_scene_items(
    scenes: dict[str, Any], origins: dict[str, str], headers: dict[str, ItemHeader] | None = None
) -> None:
    """Fill in ``path`` of each scene that names a STAC item (``scenes.X.stac``, its asset ``scenes.X.asset``),
    in place; its origin names the item (``headers``: each trusted item header by scene name)."""
    for name, scene in scenes.items():
        if not isinstance(scene, dict):
            continue
        where = origins.get(name, f"scenes.{name}")
        if "asset" in scene and "stac" not in scene:
            raise ConfigError(f"config: {where}: key 'asset' is the asset of a STAC item, and 'stac' is not set")
        if "stac" not in scene:
            continue
        source = scene["stac"]
        if not isinstance(source, str):
            raise ConfigError(f"config: key 'scenes.{name}.stac': {source!r} is not of type 'string'")
        if "path" in scene:
            raise ConfigError(f"config: {where}: set 'path' or 'stac' (a STAC item's asset), not both")
        items = read_items(source)
        if len(items) != 1:
            raise ConfigError(
                f"{source}: scenes.{name}.stac names {len(items)} STAC items, not one; list a collection's items "
                "under stac.items (a scene per item)"
            )
        asset = scene.get("asset", DEFAULT_ASSET)
        scene["path"] = scene_of(items[0], asset, source, f"scenes.{name}.asset", headers, name)
        origins[name] = item_origin(items[0]["id"], source) + (f", {where}" if name in origins else "")


def add_section_scenes(
    scenes: dict[str, Any],
    origins: dict[str, str],
    section: Mapping[str, Any],
    headers: dict[str, ItemHeader] | None = None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """``scenes`` (a mapping) with the ``stac`` section's scenes after them; a name given twice fails."""
    found, found_origins = scenes_from_section(section, headers)
    for name in found:
        if name in scenes:
            where = origins.get(name, f"scenes.{name}")
            raise ConfigError(
                f"config: key 'stac.items': {found_origins[name]} gives the scene name '{name}', which {where} "
                "already has; rename one"
            )
    return {**scenes, **found}, {**origins, **found_origins}
