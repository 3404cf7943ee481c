"""`python -m finetune ...` (what torchrun runs on every node: `torchrun ... -m finetune sft ...`) and the `finetune`
script: cli.main in a process of its own, which ends without the interpreter's teardown."""
import atexit
import os
import sys

status = []  # the SystemExit status that every command ends with (a traceback ends as Python ends it)
# registered before anything is imported, so it runs after every other atexit handler (and after the threads are
# joined): freeing what torch, transformers and datasets imported would cost ~1.5 s of CPU in each process
atexit.register(lambda: status and (sys.stdout.flush(), sys.stderr.flush(), os._exit(status[0])))


def run() -> None:
    from .cli import main
    try:
        main()
    except SystemExit as e:
        status.append(e.code if isinstance(e.code, int) else int(e.code is not None))  # as Python exits on it
        raise


if __name__ == "__main__":
    run()
