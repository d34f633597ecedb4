"""read_safetensors on damaged files: every way a file can be broken comes out as one TensorFileError (a
ValueError) that names the file and its size, never safetensors' own error, which names neither."""

from __future__ import annotations

import pytest
import torch

from parallel_attention.checkpointing.tensor_io import TensorFileError, read_safetensors, write_safetensors


def _damaged(path, how: str) -> None:
    """A good file cut in half, 64 bytes of text, or nothing at all."""
    write_safetensors(path, {"w": torch.arange(1000, dtype=torch.float32)})
    whole = path.read_bytes()
    path.write_bytes({"truncated": whole[: len(whole) // 2], "garbage": b"not a safetensors file, " * 3,
                      "empty": b""}[how])


@pytest.mark.parametrize("how", ["truncated", "garbage", "empty"])
def test_a_damaged_file_is_named_with_its_size(tmp_path, how):
    path = tmp_path / "model_tp00.safetensors"
    _damaged(path, how)
    size = path.stat().st_size
    with pytest.raises(TensorFileError, match=rf"{path} \({size} bytes\) is not a readable safetensors file .*"
                                              "copy or download it again") as caught:
        read_safetensors(path)
    assert isinstance(caught.value, ValueError) and "\n" not in str(caught.value)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(TensorFileError, match=rf"{tmp_path / 'gone.safetensors'} \(no such file\)"):
        read_safetensors(tmp_path / "gone.safetensors")


def test_a_good_file_reads_back(tmp_path):
    write_safetensors(tmp_path / "a.safetensors", {"w": torch.ones(3)}, {"k": "v"})
    tensors, meta = read_safetensors(tmp_path / "a.safetensors")
    assert torch.equal(tensors["w"], torch.ones(3)) and meta == {"k": "v"}
