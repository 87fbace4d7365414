"""make bench: the prediction benchmark (not part of the tests). Writes results/bench.json and results/bench.txt, and
this CPU's entry of results/throughput.json (the prediction job's tiles/s per core, for the dry run's cost estimate).

Every figure is measured in this one run on this machine (measures.py says how); --quick runs the same code
on small sizes, to check the harness in a minute.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from measures import OVERLAP, PATCH  # noqa: E402
from rasterscale.jobs.paths import throughput_file  # noqa: E402
from rasterscale.workflow.throughput import write_throughput  # noqa: E402
from suite import QUICK, Sizes, find_trained_model, format_table, run_bench  # noqa: E402
from throughput import cpu_entry  # noqa: E402

MODEL = f"RetinaNet-resnet50, {PATCH} px tiles"  # the bench's detector (synthetic.write_detector)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(REPO / "results/bench.json"))
    parser.add_argument("--quick", action="store_true", help="small sizes: checks the harness, not the targets")
    parser.add_argument("--workdir", help="scratch folder (default: a temporary one, removed afterwards)")
    parser.add_argument("--model", help="trained model for the fp32 agreement (default: the bench's or the demo's)")
    parser.add_argument("--raster", help="a scene the --model was not trained on")
    parser.add_argument(
        "--throughput",
        default=str(REPO / throughput_file()),
        help="the file this CPU's throughput entry goes to (not with --quick; '' for none)",
    )
    args = parser.parse_args()
    sizes = QUICK if args.quick else Sizes()
    if bool(args.model) != bool(args.raster):
        parser.error("--model and --raster go together")
    trained = (Path(args.model), Path(args.raster)) if args.model else find_trained_model()
    with tempfile.TemporaryDirectory(prefix="rasterscale-bench-", dir=args.workdir) as workdir:
        result = run_bench(Path(workdir), sizes, trained)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    table = format_table(result)
    out.with_suffix(".txt").write_text(table + "\n")
    print(table)
    print(f"-> {out}, {out.with_suffix('.txt')}")
    if args.throughput and not args.quick:  # --quick's small job is no throughput figure
        print(
            f"-> {write_throughput(cpu_entry(result, PATCH, OVERLAP, MODEL), args.throughput)} (this CPU's throughput)"
        )


if __name__ == "__main__":
    main()
