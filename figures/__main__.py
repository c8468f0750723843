import sys

from figures.build import main

sys.exit(main())
