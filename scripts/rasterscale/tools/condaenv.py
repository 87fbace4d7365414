"""The rules' conda environment (``envs/environment.yaml``) from the pinned requirements (``envs/requirements.txt``).

Every rule names ``conda: "../envs/environment.yaml"`` (``snakemake --sdm conda``). Snakemake creates an
environment from that file's text alone, in a folder of its own, so the file cannot read the requirements by a
relative path (``-r requirements.txt``): it lists every pin itself, under ``pip:``, as the requirements file does
(comments kept, index options such as ``--extra-index-url`` kept: conda hands the list to pip as a requirements
file). :func:`render_environment` writes it; ``make envs`` (scripts/conda_env.py) runs it and tests/test_deploy.py
checks that the file is what it renders. Standard library only: ``make envs`` needs no virtual environment.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

NAME = "rasterscale"
PYTHON = "3.11"  # the oldest Python the pins support (requires-python in pyproject.toml)
CHANNELS = ("conda-forge", "nodefaults")
INDENT = "      "  # of a pip entry: under "  - pip:"

HEADER = """\
# Generated from envs/requirements.txt by `make envs` (scripts/rasterscale/tools/condaenv.py): edit the
# requirements, then regenerate (tests/test_deploy.py checks the two agree).
# The conda environment of every rule (`snakemake --sdm conda`: Snakemake creates it from this file alone, so the
# pins are listed here, not read from requirements.txt), and for clusters:
#   conda env create -f envs/environment.yaml && conda activate rasterscale
# Python comes from conda-forge; every package, pinned exactly, from pip as in .venv.
"""

# pip options a requirements file may hold that conda's pip section passes on as they are (no file they name)
PASSED_OPTIONS = (
    "--index-url",
    "-i",
    "--extra-index-url",
    "--find-links",
    "-f",
    "--trusted-host",
    "--pre",
    "--prefer-binary",
    "--only-binary",
    "--no-binary",
)
# a plain YAML scalar that needs no quotes: a requirement's characters, not starting with one YAML gives a meaning
PLAIN = re.compile(r"^[A-Za-z0-9_.\[\]][A-Za-z0-9_.\-\[\],=<>!~*+/]*$")


@dataclass(frozen=True)
class Entry:
    """A line of the pip list: a requirement or option (``text``) with its comment, or a comment line alone."""

    text: str = ""
    comment: str = ""

    def render(self) -> str:
        comment = f"# {self.comment}" if self.comment else "#"
        if not self.text:
            return f"{INDENT}{comment}"
        item = self.text if PLAIN.match(self.text) else '"' + self.text.replace('"', '\\"') + '"'
        return f"{INDENT}- {item}" + (f"  {comment}" if self.comment else "")


def parse_requirements(text: str, source: str = "envs/requirements.txt") -> list[Entry]:
    """The entries of a requirements file, in its order (blank lines dropped); a line conda's pip section cannot
    take (another file by ``-r``/``-c``/``-e``, a continued line) is a ValueError naming ``source`` and the line."""
    entries = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            entries.append(Entry(comment=line.lstrip("#").strip()))
            continue
        requirement, *rest = re.split(r"\s+#", line, maxsplit=1)  # pip: a comment starts at a "#" after a space
        comment = rest[0].strip() if rest else ""
        if requirement.endswith("\\"):
            raise ValueError(f"{source}, line {number}: a continued line: write the requirement on one line")
        if requirement.startswith("-"):
            option = requirement.split("=", 1)[0].split()[0]
            if option not in PASSED_OPTIONS:
                raise ValueError(
                    f"{source}, line {number}: {option} is not passed to conda's pip section (it names a file or"
                    " a local path that Snakemake does not copy): list the pins themselves"
                )
            requirement = " ".join(requirement.split())
        entries.append(Entry(requirement, comment))
    return entries


def render_environment(requirements: str, source: str = "envs/requirements.txt") -> str:
    """envs/environment.yaml's text for the requirements file's text."""
    lines = [HEADER.rstrip("\n"), f"name: {NAME}", "channels:"]
    lines += [f"  - {channel}" for channel in CHANNELS]
    lines += ["dependencies:", f"  - python={PYTHON}", "  - pip", "  - pip:"]
    lines += [entry.render() for entry in parse_requirements(requirements, source)]
    return "\n".join(lines) + "\n"
