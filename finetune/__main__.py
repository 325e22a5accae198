"""`python -m finetune TASK [--config configs/finetune/TASK.yaml] [section.key=value ...]`."""
import sys

from .main import main

sys.exit(main())
