"""``python -m apps.eval --config <run or eval config> checkpoint=<path>`` (:mod:`apps.eval.main`)."""

from apps.fast_help import exit_on_config_error, print_saved_help

print_saved_help("eval")  # before the imports below (seconds)
exit_on_config_error("apps.eval.config:check_config", prog="python -m apps.eval")

from apps.eval.main import main  # noqa: E402
from forge_ext.runtime.supervision import shutdown_monarch

try:
    main()
finally:  # the program's end: not in Monarch's 1-second atexit hook (see shutdown_monarch)
    shutdown_monarch()
