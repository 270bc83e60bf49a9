"""The README's pictures of TensorBoard and MLflow showing dtrain's runs.

usage: python tools/screenshots.py TRACK OUT_DIR
  TRACK: the folder tools/stage_curves.sh filled (TRACK=DIR), holding
         mlruns/ (--mlflow) and tensorboard/ (--tensorboard) of three stages
  writes OUT_DIR/tensorboard.png and OUT_DIR/mlflow.png

It starts `tensorboard --logdir TRACK/tensorboard` and `mlflow ui
--backend-store-uri TRACK/mlruns` on free local ports, opens each in a
headless Chromium and saves the page once its charts have drawn. It needs,
beside the Python it runs in: tensorboard, mlflow (the whole package: the
UI is not in mlflow-skinny), playwright, and a Chromium (Debian's `chromium`,
or CHROMIUM=PATH). None of the tests needs them; .ci/run does not install
them.
"""
import os
import socket
import subprocess
import sys
import time
import urllib.request

from playwright.sync_api import sync_playwright


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def color_runs(store):
    """MLflow colours a run by a hash of its id, which can give two runs one
    grey; pick each its own, as the UI's colour picker does (the run tag
    mlflow.runColor), in the order the runs started."""
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri="file://" + os.path.abspath(store))
    experiment = client.get_experiment_by_name("dtrain")
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    for run, color in zip(runs, ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2"]):
        client.set_tag(run.info.run_id, "mlflow.runColor", color)


def serve(command, url, name):
    """Start a server and wait (at most 60 s) until it answers url."""
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env=dict(os.environ, MLFLOW_ALLOW_FILE_STORE="true"))
    for _ in range(120):
        try:
            urllib.request.urlopen(url, timeout=1)
            return server
        except OSError:
            if server.poll() is not None:
                sys.exit(f"screenshots.py: {name} stopped (exit {server.returncode}): {' '.join(command)}")
            time.sleep(0.5)
    server.kill()
    sys.exit(f"screenshots.py: {name} did not answer {url} within 60 s")


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__.split("\n\n")[1])
    track, out = sys.argv[1], sys.argv[2]
    for sub in ("mlruns", "tensorboard"):
        if not os.path.isdir(os.path.join(track, sub)):
            sys.exit(f"screenshots.py: no {os.path.join(track, sub)}: run TRACK={track} tools/stage_curves.sh first")
    os.makedirs(out, exist_ok=True)
    color_runs(os.path.join(track, "mlruns"))
    bindir = os.path.dirname(sys.executable)
    tb_port, ml_port = free_port(), free_port()
    tb = serve([os.path.join(bindir, "tensorboard"), "--logdir", os.path.join(track, "tensorboard"), "--port", str(tb_port)],
               f"http://127.0.0.1:{tb_port}/", "tensorboard")
    ml = serve([os.path.join(bindir, "mlflow"), "ui", "--backend-store-uri", os.path.join(track, "mlruns"), "--host", "127.0.0.1",
                "--port", str(ml_port)], f"http://127.0.0.1:{ml_port}/", "mlflow ui")
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=os.environ.get("CHROMIUM", "/usr/bin/chromium"), args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            # TensorBoard: the losses and the speed, unsmoothed, so the runs' own values show
            page.goto(f"http://127.0.0.1:{tb_port}/?smoothing=0&tagFilter=loss%7Ctokens_per_s#timeseries")
            page.wait_for_selector("text=train/loss", timeout=60000)
            settings = page.locator("button[aria-label='Toggle settings side pane']")
            if settings.count():
                settings.first.click()
            page.wait_for_timeout(4000)
            page.screenshot(path=os.path.join(out, "tensorboard.png"))
            # MLflow: the experiment's runs and their metrics, overlaid, one chart each
            page.goto(f"http://127.0.0.1:{ml_port}/#/experiments/1/runs?compareRunsMode=CHART")
            page.wait_for_selector("text=Model metrics", timeout=60000)
            page.wait_for_timeout(4000)
            close = page.locator("button[aria-label='Close']")     # the assistant's side panel
            if close.count():
                close.first.click()
                page.wait_for_timeout(1500)
            page.screenshot(path=os.path.join(out, "mlflow.png"))
            browser.close()
    finally:
        tb.kill()
        ml.kill()
    print(f"wrote {os.path.join(out, 'tensorboard.png')} and {os.path.join(out, 'mlflow.png')}")


if __name__ == "__main__":
    main()
