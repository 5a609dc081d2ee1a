"""The deployment files (deploy/) against the code they deploy.

No container engine runs on the build machines and no test boots systemd, so
what can be checked is checked without them: the unit passes
``systemd-analyze verify`` with no warning (an unknown key or an unparsable
value is only a warning there, and systemd would ignore it at boot), and both
files name only what exists: the command ``make`` installs, files in the
checkout, settings the server reads. Building the image is not proven here.
"""

from __future__ import annotations

import glob
import json
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

from shoal.config import Settings

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "deploy" / "shoal.service"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"


def installed_command(directory: str) -> str:
    """Where ``make`` puts the ``shoal`` command in a checkout at ``directory``."""
    venv = re.search(r"^VENV\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "shoal" in scripts
    return f"{directory}/{venv}/bin/shoal"


def unit_entries() -> list[tuple[str, str]]:
    return [tuple(part.strip() for part in line.split("=", 1))
            for line in UNIT.read_text().splitlines()
            if "=" in line and not line.startswith(("#", ";", "["))]


def setting_names(assignments: list[str]) -> set[str]:
    """The SHOAL_* names in assignments like ``SHOAL_A=1 SHOAL_B=@%d/x``."""
    return {word.split("=", 1)[0] for text in assignments for word in shlex.split(text)
            if word.startswith("SHOAL_")}


def unknown_settings(names: set[str]) -> set[str]:
    known = {f"SHOAL_{field.upper()}" for field in Settings.model_fields}
    return names - known


def test_the_unit_verifies_without_a_warning(tmp_path):
    verify = shutil.which("systemd-analyze")
    assert verify, "systemd-analyze is missing: make test installs it (runtime/test-packages.txt)"
    entries = dict(unit_entries())
    # Verified as it would be in this checkout (verify wants ExecStart's binary).
    unit = tmp_path / "shoal.service"
    unit.write_text(UNIT.read_text().replace(entries["WorkingDirectory"], str(ROOT)))
    run = subprocess.run([verify, "verify", str(unit)], capture_output=True, text=True)
    assert (run.returncode, run.stderr) == (0, ""), run


def test_the_unit_names_what_exists():
    entries = unit_entries()
    values = dict(entries)
    assert values["ExecStart"] == installed_command(values["WorkingDirectory"]) + " serve"
    names = setting_names([value for key, value in entries if key == "Environment"])
    assert {"SHOAL_TOKENS", "SHOAL_OPERATOR_TOKENS", "SHOAL_DATA_DIR"} <= names
    assert not unknown_settings(names)
    # The directories systemd makes are the ones the settings point at.
    assert "SHOAL_DATA_DIR=/var/lib/shoal" in " ".join(v for k, v in entries if k == "Environment")
    assert values["StateDirectory"] == "shoal"


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip())
            for line in text.splitlines() if line.strip() and not line.startswith("#")]


def test_the_dockerfile_copies_runs_and_starts_what_exists():
    instructions = dockerfile_instructions()
    workdir = next(argument for kind, argument in instructions if kind == "WORKDIR")
    copied = set()
    for kind, argument in instructions:
        if kind != "COPY":
            continue
        *sources, _ = argument.split()
        for source in sources:
            assert glob.glob(str(ROOT / source)), f"COPY {source}: not in the checkout"
            copied.add(source.rstrip("/"))
    # Each script a RUN calls before the whole checkout is copied was copied for it.
    whole = [i for i, (kind, argument) in enumerate(instructions)
             if kind == "COPY" and argument.split()[0] == "."]
    for kind, argument in instructions[:whole[0]]:
        if kind == "RUN":
            for script in re.findall(r"bash (\S+\.sh)", argument):
                assert any(script == c or script.startswith(c + "/") for c in copied), script
    (entrypoint,) = [json.loads(argument) for kind, argument in instructions
                     if kind == "ENTRYPOINT"]
    assert entrypoint == [installed_command(workdir), "serve"]
    names = setting_names([argument for kind, argument in instructions if kind == "ENV"])
    assert names and not unknown_settings(names), names
    # make runtime is what installs the command (and the runtime it serves with).
    assert any(kind == "RUN" and "make runtime" in argument for kind, argument in instructions)
