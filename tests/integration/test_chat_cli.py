"""``kunlun-runtime chat`` streams replies to lines read from stdin and exits 0 at end of input."""

import subprocess
import sys

from tests.support.tiny_models import TINY_SPECS, make_tiny_model


def test_chat_answers_each_line_and_keeps_the_history(tmp_path):
    model_dir = make_tiny_model(tmp_path / "tiny", TINY_SPECS["llama-gqa"])
    command = [
        sys.executable, "-c", "import sys; from kunlun_runtime.commands.cli import main; sys.exit(main(sys.argv[1:]))",
        "chat", "--model", str(model_dir), "--dtype", "float32", "--max-tokens", "5", "--kv-cache-memory", "8MiB",
    ]  # fmt: skip
    result = subprocess.run(command, input="hello\n\nthe end\n", capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("assistant> ") == 2  # the empty line is skipped
    assert result.stdout.count("you> ") == 3 + 1  # three lines read, then the prompt that meets EOF
