"""The notebooks execute on small configurations, so they never rot."""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


@pytest.mark.parametrize("name", ["timeline", "sweeps", "validation"])
def test_notebook_executes(name, monkeypatch):
    if name == "validation":
        pytest.importorskip("torch")
    monkeypatch.setenv("KLOTSKI_NOTEBOOK_SMALL", "1")
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the notebook's own (inline) backend, as a reader's
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
    )
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    # every cell that draws shows its picture (a library that forced a backend would leave them empty)
    drawing = [
        c
        for c in nb.cells
        if c.cell_type == "code"
        and any(call in c.source for call in ("gantt(", "plt.show", ".plot(", "side_by_side(", "plt.subplots("))
    ]
    assert drawing
    for cell in drawing:
        images = [o for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
        assert images, f"{name}: this cell draws but shows no image:\n{cell.source[:200]}"
