"""A sequential model cut into pipeline stages (``stages.py``) and the split that balances the stages over
devices of different speeds and memory (``split.py``): shared by the pipeline strategy (train/pipeline.py)
and ``edgetrain plan``. Design: docs/design/pipeline.md."""
