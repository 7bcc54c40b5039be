"""The README's Python API example runs as written (on a tiny target with SmolLM2's tokenizer), and
its table of targets is the one ``benchmarks/results/targets.json`` gives."""

import json
import re
from pathlib import Path

import pytest

from tiny_chat import tiny_chat_target
from tiny_eagle import make_eagle_dir

README = Path(__file__).resolve().parent.parent / "README.md"


def python_api_example() -> str:
    section = README.read_text().split("## Python API", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_python_api_example_runs(tmp_path, capsys):
    model, _ = tiny_chat_target(tmp_path)
    head = make_eagle_dir(tmp_path / "head", json.loads((model / "config.json").read_text()), draft_vocab=512)
    code = python_api_example()
    assert '"/path/to/model"' in code and '"/path/to/eagle3-head"' in code
    code = code.replace('"/path/to/model"', repr(str(model))).replace('"/path/to/eagle3-head"', repr(str(head)))
    code = code.replace("max_tokens=64", "max_tokens=8").replace("seed=7)", "seed=7, max_tokens=8)")  # CPU time
    exec(compile(code, "README.md (Python API)", "exec"), {})
    out = capsys.readouterr().out
    assert re.search(r"\b(stop|length)\b", out)  # result.finish_reason was printed


def test_the_readmes_targets_table_is_targets_json():
    from benchmarks.targets_table import TARGETS, table
    text = README.read_text()
    start = text.index("<!-- targets table: python benchmarks/targets_table.py -->\n")
    shown = text[start:text.index("\n<!-- end of the targets table -->")].split("\n", 1)[1]
    assert shown == table(json.loads(TARGETS.read_text()))
