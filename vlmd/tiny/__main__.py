import sys

from vlmd.tiny import main

sys.exit(main())
