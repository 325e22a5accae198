"""What every layer of the library uses and none owns: the user-facing error classes (errors.py),
reading users' text files with the file, line and byte named (textfile.py), a full disk named
(diskspace.py), the one atomic writer of outputs and small files (atomic.py), and the one list of
library warnings the programs hide (quiet.py)."""
