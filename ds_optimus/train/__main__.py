from ..command_line import exit_without_teardown
from .cli import main

exit_without_teardown(main())
