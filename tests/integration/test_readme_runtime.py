"""The README's offline-API snippet runs as written and does what it says."""

import json
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def test_offline_api_snippet_runs_as_written(capsys):
    (snippet,) = [
        block for block in python_blocks(README.read_text()) if "from kunlun_runtime import" in block
    ]
    namespace: dict = {}
    exec(compile(snippet, "README.md", "exec"), namespace)
    out = namespace["out"]
    assert len(out) == 2 and out[1].prompt_token_ids == [1, 504, 3575]
    assert all(o.outputs[0].finish_reason in {"stop", "length"} for o in out)
    printed = capsys.readouterr().out
    assert out[0].outputs[0].text in printed and printed.strip()
    record = namespace["llm"].generate("A user record as JSON:", namespace["json_params"])[0].outputs[0]
    assert record.finish_reason == "stop" and isinstance(json.loads(record.text)["name"], str)
    assert record.text in printed  # greedy: the same text the snippet printed
