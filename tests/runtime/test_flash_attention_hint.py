"""The Megatron backend's FlashAttention check names the fix when a FlashAttention-3 wheel installed its interface as
the top-level module flash_attn_interface, where megatron-core 0.19 does not look (it imports
flash_attn_3.flash_attn_interface). The modules are found, never imported: the files here are empty and no CUDA is
needed."""
from __future__ import annotations

import importlib
import shutil
import sys

import pytest

from rlc.runtime.generation import megatron_engine as E


@pytest.fixture
def site(tmp_path, monkeypatch):
    """An empty directory first on sys.path, with the modules it defines forgotten before and after."""
    def forget():
        for name in [m for m in sys.modules if m.split(".")[0] in ("flash_attn_3", "flash_attn_interface")]:
            del sys.modules[name]
        importlib.invalidate_caches()

    forget()
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    forget()


def test_no_flash_attention_3_no_hint(site):
    assert E.fa3_layout_hint() is None


def test_wheel_layout_names_the_copy_and_the_copied_layout_needs_none(site):
    (site / "flash_attn_3").mkdir()
    (site / "flash_attn_3" / "_C.abi3.so").write_bytes(b"")
    (site / "flash_attn_interface.py").write_text("", encoding="utf-8")
    importlib.invalidate_caches()
    hint = E.fa3_layout_hint()
    assert hint is not None
    assert str(site / "flash_attn_interface.py") in hint and str(site / "flash_attn_3") in hint
    assert "flash_attn_3.flash_attn_interface" in hint
    shutil.copy(site / "flash_attn_interface.py", site / "flash_attn_3" / "flash_attn_interface.py")
    importlib.invalidate_caches()
    assert E.fa3_layout_hint() is None


def test_the_missing_message_names_the_tested_package_and_the_vllm_conflict():
    assert "tokenspeed-fa3 3.0.0.post20260810" in E.FLASH_ATTENTION_MISSING
    assert "vLLM #42675" in E.FLASH_ATTENTION_MISSING and "generation.backend: vllm" in E.FLASH_ATTENTION_MISSING
