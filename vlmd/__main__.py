from vlmd.cli import main

main()
