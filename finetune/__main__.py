"""`python -m finetune TASK [--config configs/finetune/TASK.yaml] [section.key=value ...]`."""
import sys

from .run import main

sys.exit(main())
