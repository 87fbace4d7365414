"""Entry: write the configuration reference (docs/configuration.md) from config/schema.yaml (`make docs`)."""

import argparse
import sys
from pathlib import Path

from rasterscale.atomic import atomic_path
from rasterscale.config.schema import SCHEMA_PATH, load_schema
from rasterscale.tools.configdoc import render_reference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--schema", type=Path, default=SCHEMA_PATH, help="the schema (default: config/schema.yaml)")
    parser.add_argument("--out", type=Path, help="Markdown file to write (default: standard output)")
    args = parser.parse_args()
    text = render_reference(load_schema(args.schema))
    if args.out is None:
        sys.stdout.write(text)
        return
    with atomic_path(args.out) as tmp:
        tmp.write_text(text)
    print(f"config_reference: wrote {args.out}")


if __name__ == "__main__":
    main()
