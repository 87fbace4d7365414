"""Scenes from STAC: a scene's raster may be an asset of a STAC Item (``scenes.X.stac`` and ``scenes.X.asset``), and
the ``stac`` section lists Items and ItemCollections (a search's results saved as JSON), a scene per item named by
its id. Each Item is a local JSON file or an http(s) URL, read once per invocation (with the scene tables and
globs, before validation) and parsed with pystac; the scene's ``path`` is the asset's href made absolute (a
relative href against the item's own location), and a URL's raster is read where it lives
(:mod:`rasterscale.raster.remote`). An item that will not read, or one without the asset, fails with one line
naming it."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rasterscale.config.scenes import STAC_ORIGIN, sanitized_scene_name
from rasterscale.errors import ConfigError, InputError

if TYPE_CHECKING:
    import pystac

DEFAULT_ASSET = "visual"  # STAC's role and common key of a true-colour (RGB uint8) asset
TIMEOUT_S = 60  # reading one item or collection over HTTP


def is_url(source: str) -> bool:
    return source.startswith(("https://", "http://"))


def read_json(source: str) -> Any:
    """The JSON of a local file or an http(s) URL; one line naming it when it cannot be read."""
    try:
        if is_url(source):
            request = urllib.request.Request(source, headers={"Accept": "application/geo+json, application/json"})
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
                text = response.read().decode("utf-8")
        else:
            text = Path(source).read_text(encoding="utf-8")
    except FileNotFoundError as err:
        raise InputError(f"{source}: STAC item not found") from err
    except urllib.error.HTTPError as err:
        raise InputError(f"{source}: STAC item cannot be read (HTTP {err.code}: {err.reason})") from err
    except (OSError, urllib.error.URLError, UnicodeDecodeError, ValueError) as err:
        reason = getattr(err, "reason", None) or err
        raise InputError(f"{source}: STAC item cannot be read ({reason})") from err
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise InputError(f"{source}: STAC item is not JSON ({err})") from err


def read_items(source: str) -> list[pystac.Item]:
    """The STAC Items of a source: one Item, or the items of an ItemCollection (a GeoJSON FeatureCollection)."""
    import pystac  # here, not at the top: a config without STAC does not pay its import

    data = read_json(source)
    kind = data.get("type") if isinstance(data, dict) else None
    try:
        if kind == "Feature":
            return [pystac.Item.from_dict(data, href=source if is_url(source) else str(Path(source).resolve()))]
        if kind == "FeatureCollection":
            return list(pystac.ItemCollection.from_dict(data).items)
    except (pystac.STACError, KeyError, TypeError, ValueError) as err:
        raise InputError(f"{source}: not a valid STAC item ({type(err).__name__}: {err})") from err
    raise InputError(
        f"{source}: not a STAC Item or ItemCollection (its type is {kind!r}, not 'Feature' or 'FeatureCollection')"
    )


def asset_path(item: pystac.Item, asset: str, source: str, key: str) -> str:
    """The raster of an item's asset: its href, made absolute against the item's location when relative."""
    from pystac.utils import make_absolute_href

    if asset not in item.assets:
        known = ", ".join(sorted(item.assets)) or "none"
        raise ConfigError(f"{source}: STAC item '{item.id}' has no asset '{asset}' (its assets: {known}); set {key}")
    href = item.assets[asset].href
    if "://" in href or href.startswith("/"):
        return href
    base = item.get_self_href() or (source if is_url(source) else str(Path(source).resolve()))
    return make_absolute_href(href, base)


def item_origin(item_id: str, source: str) -> str:
    return f"{STAC_ORIGIN} '{item_id}' of {source}"


def scenes_from_section(section: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The scenes of the ``stac`` section: one per item of each source in ``stac.items``, named by the item's id,
    its path the ``stac.asset`` asset's, with ``stac.bands``, ``stac.scale`` and ``stac.normalize`` when set; and
    their origins."""
    scenes: dict[str, Any] = {}
    origins: dict[str, str] = {}
    shared = {key: section[key] for key in ("bands", "scale", "normalize") if key in section}
    for source in section.get("items", []):
        for item in read_items(source):
            name = sanitized_scene_name(item.id)
            if not name:
                raise ConfigError(f"{source}: STAC item id '{item.id}' gives no usable scene name")
            if name in scenes:
                raise ConfigError(
                    f"config: key 'stac.items': {item_origin(item.id, source)} gives the scene name '{name}', as "
                    f"{origins[name]} does: a scene per item"
                )
            path = asset_path(item, section.get("asset", DEFAULT_ASSET), source, "stac.asset")
            scenes[name] = {"path": path, **shared}
            origins[name] = item_origin(item.id, source)
    return scenes, origins


def resolve_scene_items(scenes: dict[str, Any], origins: dict[str, str]) -> None:
    """Fill in ``path`` of each scene that names a STAC item (``scenes.X.stac``, its asset ``scenes.X.asset``),
    in place; its origin names the item."""
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
        scene["path"] = asset_path(items[0], asset, source, f"scenes.{name}.asset")
        origins[name] = item_origin(items[0].id, source) + (f", {where}" if name in origins else "")


def add_section_scenes(
    scenes: dict[str, Any], origins: dict[str, str], section: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, str]]:
    """``scenes`` (a mapping) with the ``stac`` section's scenes after them; a name given twice fails."""
    found, found_origins = scenes_from_section(section)
    for name in found:
        if name in scenes:
            where = origins.get(name, f"scenes.{name}")
            raise ConfigError(
                f"config: key 'stac.items': {found_origins[name]} gives the scene name '{name}', which {where} "
                "already has; rename one"
            )
    return {**scenes, **found}, {**origins, **found_origins}
