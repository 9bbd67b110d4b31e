"""The README's usage example runs as written under torchrun with 2 workers."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_example_runs_under_torchrun(tmp_path):
    code = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    script = tmp_path / "train.py"
    script.write_text(code)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", str(script)],
        env=env, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # both ranks printed their step statistics (their lines may interleave), with bytes sent
    sent = re.findall(r"CommStats\(bytes_sent=([0-9.]+)", proc.stdout)
    assert len(sent) == 2 and all(float(b) > 0 for b in sent), proc.stdout
