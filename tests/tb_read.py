"""Print every scalar of a TensorBoard log folder, as TensorBoard's own
reader sees it (each folder that holds event files is a run): one line
"run tag step value" each. The suite compares them with dtrain's --log
(tests/26-metrics.c). usage: tb_read.py DIR"""
import sys

from tensorboard.backend.event_processing import event_accumulator, event_multiplexer


def main():
    runs = event_multiplexer.EventMultiplexer(size_guidance={event_accumulator.SCALARS: 0})
    runs.AddRunsFromDirectory(sys.argv[1])
    runs.Reload()
    for run in sorted(runs.Runs()):
        for tag in sorted(runs.Runs()[run]["scalars"]):
            for event in runs.Scalars(run, tag):
                print(run, tag, event.step, repr(event.value))


if __name__ == "__main__":
    main()
