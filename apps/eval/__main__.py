"""``python -m apps.eval --config <run or eval config> checkpoint=<path>`` (:mod:`apps.eval.main`)."""

from apps.eval.main import main
from forge_ext.supervision import shutdown_monarch

try:
    main()
finally:  # the program's end: not in Monarch's 1-second atexit hook (see shutdown_monarch)
    shutdown_monarch()
