"""``python -m lit_gspo ...`` is the ``lit-gspo`` command (for launchers that take a module: ``torchrun -m lit_gspo fit ...``)."""

from lit_gspo.tools.main import main

if __name__ == "__main__":
    main()
