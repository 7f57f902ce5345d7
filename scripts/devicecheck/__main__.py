import sys

from devicecheck.main import main

sys.exit(main())
