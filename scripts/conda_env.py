"""Entry: write envs/environment.yaml (the rules' conda environment) from the pins of envs/requirements.txt
(`make envs`); with --check, only say whether it is up to date (exit 1 if not)."""

import argparse
import sys
from pathlib import Path

from rasterscale.atomic import atomic_path
from rasterscale.tools.condaenv import render_environment


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requirements", type=Path, default=Path("envs/requirements.txt"))
    parser.add_argument("--out", type=Path, default=Path("envs/environment.yaml"))
    parser.add_argument("--check", action="store_true", help="write nothing: exit 1 if --out differs")
    args = parser.parse_args()
    try:
        text = render_environment(args.requirements.read_text(), str(args.requirements))
    except (OSError, ValueError) as err:
        sys.exit(f"conda_env: {err}")
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            sys.exit(f"conda_env: {args.out} is not generated from {args.requirements}: run `make envs`")
        print(f"conda_env: {args.out} is up to date")
        return
    with atomic_path(args.out) as tmp:
        tmp.write_text(text)
    print(f"conda_env: wrote {args.out} from {args.requirements}")


if __name__ == "__main__":
    main()
