"""The README's pictures of TensorBoard and MLflow showing dtrain's runs.

usage: python tools/screenshots.py TRACK OUT_DIR
       python tools/screenshots.py --live OUT_DIR
  TRACK: the folder tools/stage_curves.sh filled (TRACK=DIR), holding
         mlruns/ (--mlflow) and tensorboard/ (--tensorboard) of three stages
  writes OUT_DIR/tensorboard.png and OUT_DIR/mlflow.png
  --live: starts `mlflow server` (SQLite, in a temporary folder), trains stage
         01's small GPT with --mlflow http://127.0.0.1:PORT, and saves the run's
         page while it trains: OUT_DIR/mlflow-live.png

It starts `tensorboard --logdir TRACK/tensorboard` and `mlflow ui
--backend-store-uri TRACK/mlruns` on free local ports, opens each in a
headless Chromium and saves the page once its charts have drawn. It needs,
beside the Python it runs in: tensorboard, mlflow (the whole package: the
UI is not in mlflow-skinny), playwright, and a Chromium (Debian's `chromium`,
or CHROMIUM=PATH). None of the tests needs them; .ci/run does not install
them.
"""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"   # MLflow 3 keeps the file store behind this switch
try:
    from mlflow.tracking import MlflowClient
    from playwright.sync_api import Error as PlaywrightError, sync_playwright
except ImportError as e:
    sys.exit(f"screenshots.py: {e.name} is missing: pip install mlflow tensorboard playwright (into the Python that runs this)")


def fail(why):
    sys.exit(f"screenshots.py: {why}")


def program(name):
    """A server's command: beside this Python (a venv), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    found = here if os.access(here, os.X_OK) else shutil.which(name)
    if not found:
        fail(f"no '{name}' beside {sys.executable} or on PATH (pip install {name})")
    return found


def free_ports(n):
    """n ports free now, all different (each socket is held until all are taken)."""
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def find_chromium():
    found = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        fail("no Chromium (apt-get install chromium, or CHROMIUM=PATH)")
    return found


def mlflow_page(browser, url, ready, settle_ms):
    """An MLflow page once `ready` shows and the charts had settle_ms to draw,
    the assistant's side panel closed."""
    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    page.goto(url)
    page.wait_for_selector(ready, timeout=60000)
    page.wait_for_timeout(settle_ms)
    close = page.locator("button[aria-label='Close']").filter(visible=True)
    if close.count():
        close.first.click()
        page.wait_for_timeout(1500)
    return page


def stop(servers):
    """Each server (or run) asked to stop, then whatever of its group is left."""
    for server in servers:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(server.pid, sig)
                server.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass


def color_runs(store):
    """MLflow colours a run by a hash of its id, which can give two runs one
    grey; pick each its own, as the UI's colour picker does (the run tag
    mlflow.runColor), in the order the runs started. Returns the id of the
    experiment "dtrain"."""
    client = MlflowClient(tracking_uri="file://" + os.path.abspath(store))
    experiment = client.get_experiment_by_name("dtrain")
    if experiment is None:
        fail(f"{store} has no experiment 'dtrain': run the stages with --mlflow {store}")
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    if not 1 <= len(runs) <= 7:
        fail(f"{store}: the experiment 'dtrain' has {len(runs)} runs; the pictures are of 1 to 7 (tools/stage_curves.sh makes 3)")
    for run, color in zip(runs, ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2"]):
        client.set_tag(run.info.run_id, "mlflow.runColor", color)
    return experiment.experiment_id


def serve(command, url, name, servers, logs):
    """Start a server (kept in servers, to be stopped) and wait at most 60 s
    until it answers url; its output goes to a file, shown if it fails."""
    log = tempfile.TemporaryFile()
    logs.append(log)
    # a group of its own: mlflow ui runs its server as children, stopped with the group
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    servers.append(server)
    for _ in range(120):
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except OSError:
            if server.poll() is not None:
                break
            time.sleep(0.5)
    log.seek(0)
    tail = log.read().decode(errors="replace").strip().splitlines()[-5:]
    how = f"stopped (exit {server.returncode})" if server.poll() is not None else f"did not answer {url} within 60 s"
    fail(f"{name} {how}: {' '.join(command)}\n  " + "\n  ".join(tail))


def live(out):
    """The MLflow UI of a tracking server while a run goes on: the run's page
    once its charts have a few dozen steps, the run still RUNNING."""
    chromium = find_chromium()
    train = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "01-single-gpu", "train")
    if not os.access(train, os.X_OK):
        fail(f"no {train}: run make first")
    os.makedirs(out, exist_ok=True)
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    servers, logs = [], []
    with tempfile.TemporaryDirectory() as work:
        try:
            serve([program("mlflow"), "server", "--backend-store-uri", f"sqlite:///{work}/mlflow.db", "--default-artifact-root",
                   f"{work}/artifacts", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"], url + "/health",
                  "mlflow server", servers, logs)
            log = open(os.path.join(work, "train.out"), "w+")
            run = subprocess.Popen([train, "--model", "gpt", "--steps", "600", "--eval-every", "100", "--log-every", "50",
                                    "--mlflow", url], stdout=log, stderr=subprocess.STDOUT, cwd=work, start_new_session=True)
            servers.append(run)
            page_url = None
            for _ in range(120):                      # the run prints its page once the server made it
                log.seek(0)
                for line in log.read().splitlines():
                    if line.startswith("mlflow: run "):
                        page_url = line.split(", ", 1)[1]
                if page_url or run.poll() is not None:
                    break
                time.sleep(0.5)
            if not page_url:
                log.seek(0)
                fail("the run did not print its MLflow page:\n  " + "\n  ".join(log.read().splitlines()[-5:]))
            client = MlflowClient(tracking_uri=url)
            run_id = page_url.rsplit("/", 1)[1]
            for _ in range(240):                      # a few dozen steps on the charts
                if len(client.get_metric_history(run_id, "loss")) >= 60 or run.poll() is not None:
                    break
                time.sleep(0.5)
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
                page = mlflow_page(browser, page_url + "/model-metrics", "text=loss", 5000)
                status = client.get_run(run_id).info.status
                page.screenshot(path=os.path.join(out, "mlflow-live.png"))
                browser.close()
            if status != "RUNNING":
                fail(f"the run was {status} when the picture was taken, not RUNNING: try again on a less busy machine")
        except PlaywrightError as e:
            fail(f"the browser: {str(e).splitlines()[0]}")
        finally:
            stop(servers)
    print(f"wrote {os.path.join(out, 'mlflow-live.png')} (run {run_id}, {status} when taken)")


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--live":
        return live(sys.argv[2])
    if len(sys.argv) != 3:
        fail("usage: python tools/screenshots.py TRACK OUT_DIR, or --live OUT_DIR")
    track, out = sys.argv[1], sys.argv[2]
    for sub in ("mlruns", "tensorboard"):
        if not os.path.isdir(os.path.join(track, sub)):
            fail(f"no {os.path.join(track, sub)}: run TRACK={track} tools/stage_curves.sh first")
    chromium = find_chromium()
    os.makedirs(out, exist_ok=True)
    experiment = color_runs(os.path.join(track, "mlruns"))
    tb_port, ml_port = free_ports(2)
    servers, logs = [], []
    try:
        serve([program("tensorboard"), "--logdir", os.path.join(track, "tensorboard"), "--host", "127.0.0.1", "--port", str(tb_port)],
              f"http://127.0.0.1:{tb_port}/", "tensorboard", servers, logs)
        serve([program("mlflow"), "ui", "--backend-store-uri", os.path.join(track, "mlruns"), "--host", "127.0.0.1",
               "--port", str(ml_port)], f"http://127.0.0.1:{ml_port}/", "mlflow ui", servers, logs)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            # TensorBoard: the losses and the speed, unsmoothed, so the runs' own values show
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            page.goto(f"http://127.0.0.1:{tb_port}/?smoothing=0&tagFilter=loss%7Ctokens_per_s#timeseries")
            page.wait_for_selector("text=train/loss", timeout=60000)
            # without the step table under each chart (it has room for two runs of
            # three); the runs' colours are in the list on the left
            page.get_by_role("checkbox", name="Enable step selection and data table").uncheck()
            page.locator("button[aria-label='Toggle settings side pane']").first.click()
            page.wait_for_timeout(4000)
            page.screenshot(path=os.path.join(out, "tensorboard.png"))
            # MLflow: the experiment's runs in the chart view: every metric, the runs
            # overlaid (MLflow 3 opens an experiment on its traces otherwise)
            page = mlflow_page(browser, f"http://127.0.0.1:{ml_port}/#/experiments/{experiment}/runs?compareRunsMode=CHART",
                               "text=Model metrics", 4000)
            page.screenshot(path=os.path.join(out, "mlflow.png"))
            browser.close()
    except PlaywrightError as e:
        fail(f"the browser: {str(e).splitlines()[0]}")
    finally:
        stop(servers)
    print(f"wrote {os.path.join(out, 'tensorboard.png')} and {os.path.join(out, 'mlflow.png')}")


if __name__ == "__main__":
    main()
