from tfmcli.cli import main

main()
