"""The README's Python API example runs as written (on a tiny target with SmolLM2's tokenizer)."""

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
