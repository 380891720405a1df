"""README.md's table of the model families is the output of `python -m torchneuron.examples.zoo_run`:
every zoo model has its row (family, parameters, tokens a step), and a row recomputed now gives the
same modeled trn2 step time and MFU (the model is deterministic: modeled, not measured, time)."""
from __future__ import annotations

import pathlib
import re

import torch

from torchneuron.examples import zoo_run
from torchneuron.examples.zoo import MODELS

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
BEGIN, END = "<!-- families table: python -m torchneuron.examples.zoo_run -->", "<!-- end of families table -->"


def readme_rows() -> dict[str, list[str]]:
    text = README.read_text()
    assert BEGIN in text and END in text, f"README.md lacks the families table between {BEGIN!r} and {END!r}"
    table = text.split(BEGIN, 1)[1].split(END, 1)[0]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in table.strip().splitlines()[2:]]
    return {row[1]: row for row in rows}


def test_every_zoo_model_has_its_row():
    rows = readme_rows()
    assert set(rows) == set(MODELS), "README's families table is out of date: regenerate it with " \
                                     "`python -m torchneuron.examples.zoo_run`"
    for name, spec in MODELS.items():
        torch.manual_seed(0)
        params = sum(p.numel() for p in spec.build().parameters())
        assert rows[name][0] == spec.family
        assert rows[name][2] == f"{params / 1e3:.0f}K", f"{name}: the README's parameter count is out of date"


def test_a_row_recomputed_now_equals_the_readme():
    row = zoo_run.families_table(("llama",)).splitlines()[-1]
    cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
    assert readme_rows()["llama"] == cells
    assert re.fullmatch(r"[0-9.]+ ms", cells[4]) and float(cells[5].rstrip("%")) > 0
