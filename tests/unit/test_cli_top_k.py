"""``fleet submit image|video|xmodal --top-k``: checked before any connection, and put in the
request's inputs as ``top_k``."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from producer.cli import app
from producer.cli.submit import _with_top_k

IMAGE = Path(__file__).resolve().parents[2] / "data" / "images" / "skimage_coffee.png"


ARGS = {
    "image": ["--file", str(IMAGE)],
    "video": ["--file", str(IMAGE)],
    "xmodal": ["--image", str(IMAGE), "--text", "A cup of coffee."],
}


@pytest.mark.parametrize("command", sorted(ARGS))
@pytest.mark.parametrize("k", ["-1", "1001", "five"])
def test_out_of_range_top_k_is_a_usage_error(command: str, k: str) -> None:
    out = CliRunner().invoke(app, ["submit", command, *ARGS[command], "--top-k", k])
    assert out.exit_code == 2, out.output
    assert "--top-k" in out.output


def test_top_k_goes_into_the_inputs_only_when_given() -> None:
    inputs = {"image_b64": "AAAA"}
    assert _with_top_k(inputs, None) == inputs
    assert _with_top_k(inputs, 0) == {"image_b64": "AAAA", "top_k": 0}
    assert _with_top_k({"video_ref": {"id": "t"}}, 3) == {"video_ref": {"id": "t"}, "top_k": 3}
