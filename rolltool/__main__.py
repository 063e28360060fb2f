from rolltool.cli import main

main()
