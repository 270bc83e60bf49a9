"""Print every scalar of TensorBoard event files, as TensorBoard's own reader
sees them: one line "tag step value" each. The suite compares them with
dtrain's --log (tests/test_dtrain.c). usage: tb_read.py DIR"""
import sys

from tensorboard.backend.event_processing import event_accumulator


def main():
    acc = event_accumulator.EventAccumulator(sys.argv[1], size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    for tag in sorted(acc.Tags()["scalars"]):
        for event in acc.Scalars(tag):
            print(tag, event.step, repr(event.value))


if __name__ == "__main__":
    main()
