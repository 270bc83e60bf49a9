"""Print what MLflow's own tracking client reads from a file store that
dtrain wrote (--mlflow DIR), for the suite to compare with dtrain's --log
(tests/26-metrics.c): per run of the "dtrain" experiment, a line
"run ID NAME STATUS", its params "param KEY VALUE", tags "tag KEY VALUE" and
every point of every metric "metric KEY STEP VALUE". usage: mlflow_read.py DIR"""
import os
import sys

os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")   # MLflow 3 keeps the file store behind this switch

from mlflow.tracking import MlflowClient


def main():
    client = MlflowClient(tracking_uri="file://" + os.path.abspath(sys.argv[1]))
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
