"""Print what MLflow's own tracking client reads from a file store that
dtrain wrote (--mlflow DIR), or from a tracking server it logged to (--mlflow
http://HOST:PORT), for the suite to compare with dtrain's --log
(tests/26-metrics.c): per run of the "dtrain" experiment, a line
"run ID NAME STATUS", its params "param KEY VALUE", tags "tag KEY VALUE" and
every point of every metric "metric KEY STEP VALUE".
usage: mlflow_read.py DIR|URL"""
import os
import sys

os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")   # MLflow 3 keeps the file store behind this switch

from mlflow.tracking import MlflowClient


def main():
    where = sys.argv[1]
    server = where.startswith("http://") or where.startswith("https://")
    client = MlflowClient(tracking_uri=where if server else "file://" + os.path.abspath(where))
    experiment = client.get_experiment_by_name("dtrain")
    for run in client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"]):
        print("run", run.info.run_id, run.info.run_name.replace(" ", "_"), run.info.status)
        for key, value in sorted(run.data.params.items()):
            print("param", key, value)
        for key, value in sorted(run.data.tags.items()):
            print("tag", key, value.replace(" ", "_"))
        for key in sorted(run.data.metrics):
            for point in client.get_metric_history(run.info.run_id, key):
                print("metric", key, point.step, repr(point.value))


if __name__ == "__main__":
    main()
