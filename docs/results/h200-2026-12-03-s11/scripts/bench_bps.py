"""tpspec bench with SAMPLED_BLOCKS_PER_SM from $BPS (session 11 experiment)."""
import os
import sys

import tpspec.exchange.ll as ll

ll.SAMPLED_BLOCKS_PER_SM = int(os.environ["BPS"])
from tpspec.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
