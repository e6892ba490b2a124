import sys

from eagle_vllm.cli import main

sys.exit(main())
