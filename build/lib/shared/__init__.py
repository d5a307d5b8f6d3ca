"""The fleet's common code: settings, task schema, tensor transport, errors, metrics."""

import os

# Arrow's default allocator (mimalloc) is not fork-safe: a child forked while another thread
# allocates through it waits forever on its page-map mutex (measured: a put in a child forked
# during another thread's put hung). glibc's malloc is (it has atfork handlers), and the
# transport allocates only IPC metadata through Arrow. Set before pyarrow is first imported
# (it reads the variable once); a choice the user made already wins.
os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")
