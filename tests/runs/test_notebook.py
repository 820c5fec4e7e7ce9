"""The analysis notebook executes (nbclient) on a small multirun and draws its figures."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
NotebookClient = pytest.importorskip("nbclient").NotebookClient
pytest.importorskip("ipykernel")  # the kernel the notebook runs on

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "experiments/notebooks/analysis.ipynb"


def test_notebook_runs_on_a_multirun(tmp_path, monkeypatch):
    sweep = tmp_path / "sweep"
    res = subprocess.run([sys.executable, "-m", "experiments.run", "-m", "policy=fcfs,priority",
                          "workload=priority", "workload.num_requests=40", "plots=false", "progress=false",
                          f"hydra.sweep.dir={sweep}"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         check=False,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stderr
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert any("parameters" in c.metadata.get("tags", []) for c in nb.cells)
    monkeypatch.setenv("SERVELAB_RUN_DIR", str(sweep))
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    # 2 runs: 2 KV figures + waste + throughput + 2 queue figures + CDFs + metric bars
    assert len(images) >= 8
    text = "".join(o.get("text", "") for o in outputs)
    assert "2 run(s) under" in text
    html = "".join(o.get("data", {}).get("text/html", "") for o in outputs)
    assert "priority" in html and "TTFT mean (ms)" in html
