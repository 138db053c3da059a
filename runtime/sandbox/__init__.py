"""The trust boundary: where candidate code runs, and what confines it. A candidate's code runs only in a host
process of its own (a fresh executable for a C or CUDA kernel; for an engine, a process forked from a clean
template, or a fresh interpreter for a server), never in the worker, which keeps the inputs, the expected
outputs, a rival's results and the clock; a host is killed after its candidate. A host can compute on the
buffers it is given (sealed shared memory; a CUDA host's device buffers, in a CUDA context of its own), print
to a file of its own, start threads as its task allows and, for an engine, its own worker processes. It
cannot reach the worker: it holds no descriptor but its socket, its code and that file (an engine's host also
the compile cache) and closes every other one on start; it and the worker are not dumpable (no process of
the same user may read their memory or trace them); it runs as the worker's user (``nobody`` when started as
root), under resource limits (address space, CPU time but for a server's engine, open files, file size, no
core file, processes), in an environment scrubbed of the controller's variables. Where the kernel has
Landlock, a C or engine host reads files only beneath the system's own directories (an engine's host also
the interpreter's, our packages' and its compile cache). Where libseccomp is installed (every command that
runs candidates says so loudly when it is not), a system-call filter is in force before a C or engine
candidate's code loads (a CUDA host loads it once its context is up: its CPU code is ours, the candidate is
device code): no socket (but an engine's unnamed local pair), no ptrace, no signal to any process, no exec,
no new process (but an engine's workers), no file opened for writing, no message left in IPC or the page
cache, no code written to memory and run (once a C or engine candidate's code is in, no executable mapping
at all); a forbidden call fails with ``EPERM``. Each host is timed from outside its code: a C kernel by the
worker's clock, less a round trip measured on a calibration host that never loads candidate code, a CUDA
kernel by events the host's own code records, an engine by the worker under the load it sends.
"""
