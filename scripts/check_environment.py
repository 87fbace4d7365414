"""Entry: DDP prediction over random tiles, no raster needed (checks ranks, devices, throughput)."""

import argparse
import json

from rasterscale.envcheck import run_environment_check
from rasterscale.runtime import run_spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", type=json.loads, required=True, help="JSON of the validated config")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--log-dir", required=True)
    args = parser.parse_args()
    run_environment_check(args.config, run_spec(args.config, "predict"), args.out_dir, args.log_dir)


if __name__ == "__main__":
    main()
