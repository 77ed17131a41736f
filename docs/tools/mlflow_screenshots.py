#!/usr/bin/env python
"""Screenshots of the MLflow UI for the docs, taken in a real headless Chromium.

    python docs/tools/mlflow_screenshots.py TRACKING_URI EXPERIMENT OUTDIR [options]

TRACKING_URI is a SQLite store (``sqlite:////abs/path/mlflow.db``): ``mlflow ui`` is started on it
on a free port (one worker, no job runner, cwd = the database's folder) and always stopped at the
end. An ``http(s)://`` URI names a server that is already running and is used as it is.

Three PNGs are written to OUTDIR (names start with --prefix, default ``mlflow_``):

  <prefix>runs.png            the experiment's runs table in the "Model training" view, the sweep's
                              parent run expanded so its child runs show, with the Dataset, Source
                              and Models columns;
  <prefix>run.png             one run's Overview page, tall enough to show the Datasets section
                              (right panel) and the Logged models table together;
  <prefix>system_metrics.png  that run's "System metrics" tab, the charts filtered to CPU and
                              memory (--system-filter).

The parent run defaults to the newest run of the experiment that has child runs
(``mlflow.parentRunId``), the run to the child that has the most of: system metrics, a dataset
input, a logged model (newest first). After each screenshot the page is checked for the text it
should show (read from the store: run names, dataset names, model names, system metric chart
titles); anything missing is listed and the exit status is 1 (the screenshot is still written,
to look at). Needs ``playwright`` (pip) and a Chromium: see docs/tools/README.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

VIEW = "workflowType=machine_learning"  # MLflow 3.x opens experiments in the GenAI view without it
RUN_NAME_COL = "attributes.`Run Name`"
# the runs table's column order and widths (px), seeded into the UI's saved view state so the run
# names are not cut and Source / Models fit a 1400 px window next to the sidebar
COLUMNS = {
    RUN_NAME_COL: 320,
    "runDateAndNestInfo": 130,  # Created
    "attributes.`Dataset`": 250,
    "duration": 80,
    "attributes.`Source`": 120,
    "attributes.`Models`": 140,
}
EXPECTED_COLUMNS = ("Dataset", "Source", "Models")
# how much of the page's main scrolling container (the tallest one that scrolls, at least half
# the window: not a table's own scroller) is out of view (px); marks that container
SCROLL_HIDDEN_JS = """() => {
  let best = null;
  for (const e of document.querySelectorAll('*')) {
    if (!['auto', 'scroll'].includes(getComputedStyle(e).overflowY)) continue;
    if (e.scrollHeight <= e.clientHeight || e.clientHeight < 0.5 * window.innerHeight) continue;
    if (!best || e.clientHeight > best.clientHeight) best = e;
  }
  if (!best) return 0;
  best.setAttribute('data-shot-scroller', '');
  return best.scrollHeight - best.clientHeight;
}"""
# the lowest bottom edge, in that container, of a text leaf, an icon/image or a bordered box
# smaller than the window (the run page ends in a tall empty spacer)
CONTENT_BOTTOM_JS = """() => {
  const H = document.documentElement.clientHeight; let b = 0;
  for (const e of document.querySelectorAll('[data-shot-scroller] *')) {
    const r = e.getBoundingClientRect();
    if (r.height <= 0 || r.width <= 0 || r.height > 0.8 * H) continue;
    const st = getComputedStyle(e);
    if (st.visibility === 'hidden' || st.display === 'none') continue;
    const text = e.children.length === 0 && (e.textContent || '').trim() !== '';
    const media = ['svg', 'IMG', 'CANVAS', 'INPUT'].includes(e.tagName);
    const border = parseFloat(st.borderBottomWidth) > 0 && st.borderBottomStyle !== 'none';
    if (!(text || media || border)) continue;
    let bottom = r.bottom;  // clipped by the boxes it scrolls or overflows in (a table's rows)
    for (let a = e.parentElement; a && !a.hasAttribute('data-shot-scroller'); a = a.parentElement) {
      if (getComputedStyle(a).overflowY !== 'visible') bottom = Math.min(bottom, a.getBoundingClientRect().bottom);
    }
    if (bottom > r.top) b = Math.max(b, bottom);
  }
  return b || H;
}"""
MAX_CHILDREN_CHECKED = 10


class Failed(Exception):
    pass


@dataclass
class Plan:
    base: str  # http://127.0.0.1:PORT
    experiment_id: str
    experiment_name: str
    parent_id: str | None
    parent_name: str | None
    children: list[tuple[str, str]]  # (run_id, name), newest first
    run_id: str
    run_name: str
    datasets: list[str]
    models: list[str]
    system_metrics: list[str] = field(default_factory=list)  # keys without "system/"


# ---------------------------------------------------------------------------- the store


def plan_from_store(uri: str, experiment: str, parent: str | None, run: str | None) -> Plan:
    from mlflow import MlflowClient

    db = sqlite_db(uri)
    if db is not None and not os.path.isfile(db):
        raise Failed(f"no SQLite store at {db} (from {uri})")
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        names = [e.name for e in client.search_experiments()]
        raise Failed(f"no experiment {experiment!r} in {uri} (there are: {', '.join(names) or 'none'})")
    eid = exp.experiment_id
    runs = client.search_runs([eid], max_results=5000, order_by=["attributes.start_time DESC"])
    by_id = {r.info.run_id: r for r in runs}
    kids: dict[str, list] = {}
    for r in runs:
        p = r.data.tags.get("mlflow.parentRunId")
        if p:
            kids.setdefault(p, []).append(r)
    if parent is None:
        parent = next((r.info.run_id for r in runs if r.info.run_id in kids), None)
    elif parent not in by_id:
        raise Failed(f"--parent {parent}: no such run in experiment {experiment!r}")
    children = kids.get(parent, []) if parent else []
    if parent and not children:
        raise Failed(f"--parent {parent} has no child runs")

    def score(r):
        return (any(k.startswith("system/") for k in r.data.metrics)
                + bool(r.inputs and r.inputs.dataset_inputs)
                + bool(r.outputs and r.outputs.model_outputs))

    if run is None:
        pool = children or runs
        if not pool:
            raise Failed(f"experiment {experiment!r} has no runs")
        run = max(pool, key=score).info.run_id  # max keeps the first (newest) of equals
    elif run not in by_id:
        raise Failed(f"--run {run}: no such run in experiment {experiment!r}")
    r = by_id[run]
    datasets = [d.dataset.name for d in (r.inputs.dataset_inputs if r.inputs else [])]
    models = []
    for m in (r.outputs.model_outputs if r.outputs else []):
        try:
            models.append(client.get_logged_model(m.model_id).name)
        except Exception:  # noqa: BLE001 - a model we cannot read is simply not checked
            pass
    return Plan(
        base="", experiment_id=eid, experiment_name=experiment,
        parent_id=parent, parent_name=by_id[parent].info.run_name if parent else None,
        children=[(c.info.run_id, c.info.run_name) for c in children],
        run_id=run, run_name=r.info.run_name, datasets=sorted(set(datasets)), models=sorted(set(models)),
        system_metrics=sorted(k[len("system/"):] for k in r.data.metrics if k.startswith("system/")),
    )


# ---------------------------------------------------------------------------- the server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sqlite_db(uri: str) -> str | None:
    """The database file of a sqlite:/// URI (sqlite:////abs/x.db is absolute, sqlite:///x.db relative)."""
    if not uri.startswith("sqlite:///"):
        return None
    path = urllib.parse.urlparse(uri).path  # "//abs/x.db" or "/x.db"
    return os.path.abspath(path[1:] if path.startswith("//") else path.lstrip("/"))


class Server:
    """`mlflow ui` in its own process group, stopped (group-wide) on exit."""

    def __init__(self, uri: str, port: int, timeout: float):
        self.uri, self.port, self.timeout = uri, port, timeout
        self.proc = None
        self.log = tempfile.NamedTemporaryFile("w+", prefix="mlflow-ui-", suffix=".log", delete=False)

    def __enter__(self) -> str:
        cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", self.uri,
               "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"]
        env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false",
                   MLFLOW_DISABLE_TELEMETRY="true", DO_NOT_TRACK="true")
        self.proc = subprocess.Popen(cmd, cwd=os.path.dirname(sqlite_db(self.uri) or "") or None, env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        base = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + self.timeout
        while True:
            if self.proc.poll() is not None:
                raise Failed(f"mlflow ui exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return base
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise Failed(f"mlflow ui did not answer on {base} within {self.timeout:.0f}s:\n{self.tail()}")
            time.sleep(0.3)

    def tail(self, n: int = 20) -> str:
        self.log.flush()
        with open(self.log.name, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def __exit__(self, *exc):
        if self.proc is not None:
            try:  # the group holds the mlflow CLI, uvicorn and its worker
                os.killpg(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    pass
                os.killpg(self.proc.pid, signal.SIGKILL)  # whatever is left of the group
            except ProcessLookupError:
                pass
            self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)
        return False


# ---------------------------------------------------------------------------- the browser


def find_chromium(given: str | None) -> str | None:
    if given:
        return given
    if os.environ.get("CHROMIUM_PATH"):
        return os.environ["CHROMIUM_PATH"]
    for name in ("chromium", "chromium-browser", "chromium-headless-shell", "chrome-headless-shell",
                 "google-chrome", "google-chrome-stable"):
        if p := shutil.which(name):
            return p
    return None  # Playwright's own browser, if `playwright install chromium` worked


def in_view(page, locator) -> bool:
    try:
        if not locator.is_visible():
            return False
        box = locator.bounding_box()
    except Exception:  # noqa: BLE001
        return False
    vp = page.viewport_size
    return bool(box) and box["x"] >= 0 and box["y"] >= 0 and \
        box["x"] + box["width"] <= vp["width"] + 1 and box["y"] + box["height"] <= vp["height"] + 1


def check_texts(page, texts, what, missing, exact=False):
    for t in texts:
        loc = page.get_by_text(t, exact=exact)
        if not any(in_view(page, loc.nth(i)) for i in range(min(loc.count(), 20))):
            missing.append(f"{what}: {t!r} not visible")


def settle(page, ms=800):
    page.evaluate("document.activeElement && document.activeElement.blur && document.activeElement.blur()")
    page.mouse.move(2, page.viewport_size["height"] - 2)
    page.wait_for_timeout(ms)


def shoot(plan: Plan, out: str, prefix: str, args) -> tuple[list[str], list[str]]:
    from playwright.sync_api import Error as PWError
    from playwright.sync_api import TimeoutError as PWTimeout
    from playwright.sync_api import sync_playwright

    eid = plan.experiment_id
    state = {"columnOrder": list(COLUMNS), "columnWidths": COLUMNS}
    init = (
        # no MLflow Assistant panel over the page
        "localStorage.setItem('mlflow.assistant.panelOpen_v1', 'false');"
        "localStorage.setItem('mlflow.assistant.fab.autoOpenedOnFirstLoad_v1', 'true');"
        f"localStorage.setItem({json.dumps(f'MLflowLocalStorage-1.1-ExperimentPage-[{json.dumps(eid)}]-ReactComponentState')},"
        f" {json.dumps(json.dumps(state))});"
    )
    written, missing = [], []
    timeout = args.page_timeout * 1000
    w, h = args.width, args.height
    launch = {"headless": True, "args": ["--disable-dev-shm-usage"] + (["--no-sandbox"] if os.geteuid() == 0 else [])}
    if exe := find_chromium(args.chromium):
        launch["executable_path"] = exe
    with sync_playwright() as p:
        try:
            browser = p.chromium.launch(**launch)
        except Exception as e:  # noqa: BLE001
            raise Failed(f"cannot start Chromium ({exe or 'Playwright bundled'}): {str(e).splitlines()[0]}\n"
                         "install one: apt-get install -y chromium (see docs/tools/README.md)") from e
        try:
            ctx = browser.new_context(viewport={"width": w, "height": h}, device_scale_factor=1)
            ctx.add_init_script(init)
            ctx.set_default_timeout(timeout)
            page = ctx.new_page()

            # 1. the runs table, the parent expanded
            url = f"{plan.base}/#/experiments/{eid}/runs?{VIEW}"
            page.goto(url)
            path = os.path.join(out, f"{prefix}runs.png")
            try:
                if plan.parent_id:
                    cell = page.locator(f'.ag-cell:has(a[href$="/runs/{plan.parent_id}"])').first
                    cell.wait_for()
                    first_child = plan.children[0][1] or plan.children[0][0]
                    if not page.get_by_text(first_child, exact=True).first.is_visible():
                        cell.locator("button").first.click()  # the "+" expander left of the name
                    page.get_by_text(first_child, exact=True).first.wait_for()
                else:
                    page.locator(".ag-row").first.wait_for()
            except PWTimeout:
                missing.append(f"runs table: parent run {plan.parent_name!r} ({plan.parent_id}) or its "
                               f"children did not show within {args.page_timeout}s at {url}")
            settle(page)
            page.screenshot(path=path)
            written.append(path)
            if plan.parent_id:
                check_texts(page, [plan.parent_name], "runs table", missing, exact=True)
                names = [n for _, n in plan.children[:MAX_CHILDREN_CHECKED] if n]
                rows_fit = max(1, (h - 300) // 32)  # ~32 px a row below ~300 px of header
                check_texts(page, names[:rows_fit], "runs table (child run)", missing, exact=True)
            cut = page.evaluate(f"""() => [...document.querySelectorAll('.ag-cell[col-id="{RUN_NAME_COL}"] a span')]
                .filter(e => e.scrollWidth > e.clientWidth + 1).map(e => e.textContent)""")
            if cut:
                print(f"note: run names cut with '…' in the table ({len(cut)}, e.g. {cut[0]!r}): "
                      f"the Run Name column is {COLUMNS[RUN_NAME_COL]} px", file=sys.stderr)
            for col in EXPECTED_COLUMNS:
                hdr = page.locator(f'.ag-header-cell [data-testid="sort-header-{col}"]')
                if hdr.count() == 0:
                    hdr = page.locator(".ag-header-cell", has_text=re.compile(rf"^\s*{col}\s*$"))
                if hdr.count() == 0:
                    missing.append(f"runs table: no {col!r} column")
                elif not in_view(page, hdr.first):
                    missing.append(f"runs table: the {col!r} column is outside the {w}px window")
            if plan.children:
                child_ids = {rid for rid, _ in plan.children}
                if plan.run_id in child_ids:
                    check_texts(page, plan.datasets[:1], "runs table (Dataset column)", missing)
                    check_texts(page, plan.models[:1], "runs table (Models column)", missing, exact=True)

            # 2. the run's overview: Datasets (right panel) and Logged models, in one tall shot
            url = f"{plan.base}/#/experiments/{eid}/runs/{plan.run_id}?{VIEW}"
            page.goto(url)
            path = os.path.join(out, f"{prefix}run.png")
            try:
                page.get_by_text(plan.run_name or plan.run_id, exact=True).first.wait_for()
                page.get_by_text(re.compile(r"^Logged models")).first.wait_for()
                for d in plan.datasets[:1]:
                    page.get_by_text(d).first.wait_for()
                for m in plan.models[:1]:
                    page.get_by_role("link", name=m, exact=True).first.wait_for()
            except PWTimeout:
                missing.append(f"run page: did not finish showing within {args.page_timeout}s at {url}")
            # the overview scrolls inside one container: grow the window by what is hidden, then
            # cut the shot below the lowest text or bordered box (the page ends in an empty spacer)
            extra = page.evaluate(SCROLL_HIDDEN_JS)
            tall = min(h + int(extra), args.max_height)
            if tall > h:
                page.set_viewport_size({"width": w, "height": tall})
            settle(page, 1200)
            bottom = min(tall, int(page.evaluate(CONTENT_BOTTOM_JS)) + 24)
            page.screenshot(path=path, clip={"x": 0, "y": 0, "width": w, "height": max(h, bottom)})
            written.append(path)
            check_texts(page, [plan.run_name], "run page", missing, exact=True)
            check_texts(page, ["Datasets"], "run page", missing, exact=True)
            check_texts(page, plan.datasets, "run page (Datasets)", missing)
            if plan.models:
                check_texts(page, [f"Logged models ({len(plan.models)})"], "run page", missing)
                check_texts(page, plan.models, "run page (Logged models)", missing, exact=True)
            else:
                print(f"note: run {plan.run_id} has no logged model", file=sys.stderr)
            if not plan.datasets:
                print(f"note: run {plan.run_id} has no dataset input", file=sys.stderr)
            page.set_viewport_size({"width": w, "height": h})

            # 3. its System metrics tab
            url = f"{plan.base}/#/experiments/{eid}/runs/{plan.run_id}/system-metrics?{VIEW}"
            path = os.path.join(out, f"{prefix}system_metrics.png")
            shown = [k for k in plan.system_metrics if re.search(args.system_filter, k)] \
                if args.system_filter else list(plan.system_metrics)
            if not plan.system_metrics:
                missing.append(f"run {plan.run_name!r} ({plan.run_id}) has no system/ metrics to chart "
                               "(log them with SystemMetricsMonitor, or pick another --run)")
            page.goto(url)
            try:
                page.get_by_text("System metrics", exact=False).first.wait_for()
                if plan.system_metrics:
                    page.get_by_text(plan.system_metrics[0], exact=True).first.wait_for()
                    if args.system_filter:
                        page.get_by_placeholder(re.compile("Search metric charts", re.I)).fill(args.system_filter)
                        page.get_by_text(re.compile(r"System metrics\s*\(\d+\)")).first.wait_for()
            except PWTimeout:
                missing.append(f"system metrics tab: did not finish showing within {args.page_timeout}s at {url}")
            settle(page, 1500)  # the charts draw
            page.screenshot(path=path)
            written.append(path)
            charts_fit = 3 * max(1, (h - 250) // 360)  # three charts a row, ~360 px a row
            check_texts(page, shown[:charts_fit], "system metrics tab (chart title)", missing, exact=True)
        except PWError as e:  # a page that did not load, a browser that died: no half answer
            done = "".join(f"\n  (written: {x})" for x in written)
            raise Failed(f"browser: {str(e).splitlines()[0]}{done}") from e
        finally:
            browser.close()
    return written, missing


# ---------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tracking_uri", help="sqlite:////abs/path/mlflow.db (or http://host:port of a running server)")
    ap.add_argument("experiment", help="experiment name")
    ap.add_argument("outdir", help="folder for the PNGs (created)")
    ap.add_argument("--parent", help="run id of the parent run to expand (default: newest run with children)")
    ap.add_argument("--run", help="run id for the run page and system metrics (default: the parent's best-equipped child)")
    ap.add_argument("--prefix", default="mlflow_", help="file name prefix (default mlflow_)")
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--height", type=int, default=900)
    ap.add_argument("--max-height", type=int, default=2400, help="cap of the tall run page shot (px)")
    ap.add_argument("--system-filter", default="cpu_utilization|system_memory",
                    help="regex typed into the system metrics chart search ('' = all charts)")
    ap.add_argument("--port", type=int, default=0, help="port for mlflow ui (default: a free one)")
    ap.add_argument("--chromium", help="Chromium binary (default: $CHROMIUM_PATH, then chromium on PATH)")
    ap.add_argument("--server-timeout", type=float, default=45, help="seconds to wait for mlflow ui")
    ap.add_argument("--page-timeout", type=float, default=20, help="seconds to wait for a page's content")
    args = ap.parse_args(argv)

    # a SIGTERM stops the server like Ctrl-C does
    def on_sigterm(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    if importlib.util.find_spec("playwright") is None:
        print("error: needs playwright: pip install playwright (see docs/tools/README.md)", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    if not args.tracking_uri.startswith(("sqlite:///", "http://", "https://")):
        print("error: the tracking URI must be sqlite:///... (or http(s):// for a running server)", file=sys.stderr)
        return 2
    try:
        if args.tracking_uri.startswith(("http://", "https://")):
            try:  # answer now rather than after the client's retries
                urllib.request.urlopen(args.tracking_uri.rstrip("/") + "/health", timeout=5).close()
            except OSError as e:
                raise Failed(f"no MLflow server answers at {args.tracking_uri}: {e}") from e
        try:
            plan = plan_from_store(args.tracking_uri, args.experiment, args.parent, args.run)
        except Exception as e:  # noqa: BLE001 - MlflowException, SQLAlchemy errors: one line
            if isinstance(e, Failed):
                raise
            raise Failed(f"reading {args.tracking_uri}: {type(e).__name__}: {str(e).splitlines()[0]}") from e
        os.makedirs(args.outdir, exist_ok=True)
        if args.tracking_uri.startswith(("http://", "https://")):
            plan.base = args.tracking_uri.rstrip("/")
            written, missing = shoot(plan, args.outdir, args.prefix, args)
        else:
            with Server(args.tracking_uri, args.port or free_port(), args.server_timeout) as base:
                plan.base = base
                written, missing = shoot(plan, args.outdir, args.prefix, args)
    except Failed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    for p in written:
        print(p)
    print(f"experiment {plan.experiment_name!r} ({plan.experiment_id}), parent {plan.parent_id}, "
          f"run {plan.run_id}, {time.monotonic() - t0:.0f}s", file=sys.stderr)
    if missing:
        print("error: the screenshots do not show everything expected:\n  " + "\n  ".join(missing),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
