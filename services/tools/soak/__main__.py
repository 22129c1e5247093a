import sys

from services.tools.soak import main

sys.exit(main())
