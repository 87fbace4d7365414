"""Entry: make demo-byom (rasterscale.tools.byom): the segmentation demo's model exported and predicted in each form."""

from rasterscale.errors import run_entry
from rasterscale.tools.byom import main

if __name__ == "__main__":
    run_entry(main)
