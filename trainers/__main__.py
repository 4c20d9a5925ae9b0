import sys

from trainers.cli import main

sys.exit(main())
