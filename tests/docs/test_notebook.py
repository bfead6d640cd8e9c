"""The example notebook (examples/explore_cache.ipynb) runs top to bottom, once per session
in a kernel on this interpreter, and shows what it says: the describe/diff tables, the promotion
scenarios and the replay plot; the committed file carries no outputs. The execution tests need
the ``test`` extra (nbclient, nbformat, ipykernel, matplotlib) and skip without it."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO_ROOT / "examples" / "explore_cache.ipynb"


# --------------------------------------------------------------------------------------------
# The committed file: valid, no outputs.


def test_committed_notebook_has_no_outputs():
    """Outputs and execution counts are never committed (clear them before committing)."""
    nb = json.loads(NOTEBOOK.read_text(encoding="utf-8"))
    assert nb["nbformat"] == 4
    dirty = [
        cell.get("id", index) for index, cell in enumerate(nb["cells"])
        if cell["cell_type"] == "code" and (cell.get("outputs") or cell.get("execution_count") is not None)
    ]
    assert not dirty, f"{NOTEBOOK.name}: cells with committed outputs or execution counts: {dirty}"


def test_committed_notebook_is_valid_nbformat():
    nbformat = pytest.importorskip("nbformat")
    nbformat.validate(nbformat.read(NOTEBOOK, as_version=4))


# --------------------------------------------------------------------------------------------
# Executing it.


def _kernel_dir(tmp_path: Path) -> Path:
    """A ``python3`` kernelspec that launches this interpreter, whatever else is installed.

    ipykernel installed with pip already ships a ``python3`` kernelspec in the environment's
    ``share/jupyter``, and jupyter_client maps its ``python`` to ``sys.executable``; but a
    user-level ``python3`` kernelspec (``~/.local/share/jupyter``) takes precedence and may point
    at another Python. Putting ours first on ``JUPYTER_PATH`` pins the kernel to this interpreter.
    """
    spec_dir = tmp_path / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (pallas-cache tests)",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec), encoding="utf-8")
    return tmp_path


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The notebook after a full top-to-bottom run: ``{cell id: cell}``."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("matplotlib")

    nb = nbformat.read(NOTEBOOK, as_version=4)
    with pytest.MonkeyPatch.context() as patch:
        jupyter_path = str(_kernel_dir(tmp_path_factory.mktemp("jupyter")))
        patch.setenv("JUPYTER_PATH", jupyter_path)
        patch.setenv("MPLBACKEND", "Agg")  # headless, like CI; the notebook must still show its PNG
        client = nbclient.NotebookClient(
            nb, timeout=600, kernel_name="python3",
            resources={"metadata": {"path": str(REPO_ROOT)}})
        start = time.perf_counter()
        client.execute()  # raises CellExecutionError at the first failing cell
        seconds = time.perf_counter() - start
    cells = {cell["id"]: cell for cell in nb.cells}
    cells["_seconds"] = seconds
    return cells


def _text(cell) -> str:
    """All plain-text output of a cell: streams and the text/plain of results and displays."""
    parts = []
    for output in cell.get("outputs", []):
        if output["output_type"] == "stream":
            parts.append(output["text"])
        elif output["output_type"] in ("execute_result", "display_data"):
            parts.append(output.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


def _row(change: str, slot: int, layer: int, expert: int) -> re.Pattern:
    """A row of a diff's text table."""
    return re.compile(rf"^\s*{change}\s+{slot}\s+{layer}\s+{expert}\s", re.MULTILINE)


def test_every_cell_ran_without_error(executed):
    for cell_id, cell in executed.items():
        if cell_id == "_seconds" or cell["cell_type"] != "code":
            continue
        assert cell["execution_count"] is not None, f"cell {cell_id} did not run"
        errors = [o for o in cell["outputs"] if o["output_type"] == "error"]
        assert not errors, f"cell {cell_id} raised: {errors[0]['ename']}: {errors[0]['evalue']}"


def test_section_1_describe_and_diff_tables(executed):
    empty = _text(executed["a-init"])
    assert "CacheState L=2 E=4 S=6 step=0 resident=0/6" in empty
    assert "slot" in empty and "usage" in empty and "empty" in empty
    # Results render as HTML tables in Jupyter too.
    html = executed["a-init"]["outputs"][-1]["data"].get("text/html", "")
    assert "<table>" in html

    step1 = _text(executed["a-step1"])
    assert "2 installed, 0 evicted, 0 refreshed" in step1
    assert _row("installed", 0, 0, 1).search(step1) and _row("installed", 1, 0, 3).search(step1)
    assert "route  3 -> slot 1" in step1  # the duplicate collapses onto one slot
    assert "route -1 -> padding" in step1

    step3 = _text(executed["a-step3"])
    assert _row("refreshed", 1, 0, 3).search(step3)

    step4 = _text(executed["a-step4"])
    assert _row("evicted", 0, 0, 1).search(step4)  # the LRU victim
    assert _row("installed", 0, 1, 3).search(step4)
    assert "resident=6/6" in _text(executed["a-full"])

    step5 = _text(executed["a-step5"])
    assert "route  2 -> cpu" in step5
    assert "cpu mask: [False, True, False]" in step5
    assert _row("installed", 2, 0, 1).search(step5)


def test_section_2_promotion_installs_the_recurring_expert(executed):
    promoted = _text(executed["promotion-diff"])
    assert "1 installed, 0 evicted, 3 refreshed" in promoted
    assert _row("installed", 3, 0, 3).search(promoted)
    assert "copies (slot <- host row): [(3, 3)]" in promoted

    plain = _text(executed["none-diff"])
    assert "0 installed, 0 evicted, 3 refreshed" in plain
    assert "route  3 -> cpu" in plain

    table = _text(executed["b-run"])
    assert re.search(r"promote_one\s+2\s+1\s+0\s+4", table)  # step 2: one copy, no CPU route
    assert re.search(r"none\s+4\s+0\s+1\s+5", table)  # step 4: still on the CPU, 5 empty slots
    scenarios = _text(executed["b-table"])
    assert re.search(r"CPU-assigned routes\s+2104\s+88", scenarios)


def test_section_3_replay_table_and_plot(executed):
    table = _text(executed["c-replay"])
    assert "synthetic:mixtral-like(tokens=64" in table
    for policy in ("full", "fraction:0.4", "cap:1"):
        assert policy in table
    assert "belady" in table

    images = [o for o in executed["c-plot"]["outputs"]
              if o["output_type"] in ("display_data", "execute_result") and "image/png" in o["data"]]
    assert images, "the plot cell showed no image/png"
    png = images[0]["data"]["image/png"]
    assert png.startswith("iVBORw0KGgo"), "image/png is not a base64 PNG"


def test_section_3_uses_the_public_record_and_plot_helpers(executed):
    """FAILS if the notebook copies table or plot code instead of calling
    pallas_cache.sizing.records/format_records/plot (which the CLI uses too)."""
    replay_src, plot_src = executed["c-replay"]["source"], executed["c-plot"]["source"]
    assert "format_records(rows" in replay_src and "records(results, trace)" in replay_src
    assert "plot(rows)" in plot_src
    assert ".plot(" not in plot_src and "add_subplot" not in plot_src and 'print(f"' not in replay_src


def test_section_4_bring_your_own_trace(executed):
    """FAILS if the bring-your-own-trace cell does not load a file trace (two requests become two
    sequences) and print its records with the cost columns."""
    text = _text(executed["d-byo"])
    assert "demo.npz" in text and "sequences=2" in text
    assert "| cache_size | cache_bytes | policy | hit_rate |" in text
    assert "modeled_ms_per_token" in text


def test_the_stated_run_time_is_the_measured_one(executed):
    """The intro's time is what this run measures (printed here, not asserted: speed belongs in
    benchmarks); FAILS only if the intro stops citing this test as its measurement."""
    seconds = executed["_seconds"]
    print(f"notebook executed in {seconds:.1f} s")
    intro = "".join(executed["intro"]["source"])
    assert "measured by\n`tests/docs/test_notebook.py`" in intro and "under a minute" in intro
